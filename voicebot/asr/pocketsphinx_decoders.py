"""pocketsphinx's decoders and the streams decoding on them: blocking code, run wherever the
decoders live (a decoding process of voicebot/asr/pocketsphinx_process.py, or the server's own
worker threads when `asr.pocketsphinx.processes` is 0), and `serve`, a decoding process's loop. It
imports no more than it needs: a decoding process imports this, pocketsphinx and nothing of the server.

A Decoder is the model: about 90 MB with the general English LM (27 MB with a grammar, which needs
no LM) and 0.3 s of CPU to build, all of it holding the GIL. Building one per stream and freeing it
at its end cost 90 MB of RSS per concurrent stream for good: glibc kept the freed pages (a server
went from 385 MB to 1.29 GB after 10 sessions had come and gone). So streams borrow decoders from
a `Decoders` pool and give them back. `keep` decoders are built at start-up, before any stream;
given back, a decoder waits for the next stream while fewer than `keep` are idle; one more is freed
and the memory returned to the system (`release_freed_memory`). A stream that finds none idle
builds its own and has one more built later (`build_later`) for the next. Memory bound:
max(keep, streams open + 1) decoders, at most `keep` of them idle.

pocketsphinx normalises features by a cepstral mean it learns from the audio it has decoded; a
cold decoder's first utterance is often cut short. A decoder lent to a stream, or renewed by its
periodic reset, starts from `cepstral_mean`: the mean of the last utterance finished on this pool,
or one the caller sets (the server's last, whichever process finished it).
"""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Callable

from voicebot.memory import release_freed_memory

# A partial hypothesis (hyp(), the GIL held) at most once per this much audio: it only feeds the
# `asr.partial` a client displays, where 5 a second reads as live. After every 40 ms chunk, py-spy
# put it at 5 % of the server's busy CPU at 8 clients; bench/pocketsphinx_finish.py --partials
# measures 1 % of the decoding's CPU saved (0.4 ms per s of audio on a grammar, 4 ms on the
# general LM), the finals the same. The final is always exact: end_utt, then hyp().
PARTIAL_INTERVAL_SAMPLES = 3200  # 200 ms at 16 kHz


def jsgf(phrases: list[str]) -> str:
    """A closed JSGF grammar that accepts exactly these phrases."""
    words = [re.sub(r"[^a-z' ]", " ", p.lower()).split() for p in phrases]
    alternatives = " | ".join(" ".join(w) for w in words if w)
    return f"#JSGF V1.0;\ngrammar phrases;\npublic <utterance> = {alternatives};\n"


def model_name(phrases: list[str]) -> str:
    return "pocketsphinx-en-us-grammar" if phrases else "pocketsphinx-en-us"


class Decoders:
    """The decoders of one process, lent to its streams (blocking; thread-safe)."""

    def __init__(self, phrases: list[str], second_pass: bool, keep: int,
                 build_later: Callable[[Callable[[], None]], object]) -> None:
        self.grammar = jsgf(phrases) if phrases else None
        self.second_pass = second_pass
        self.keep = keep
        self._build_later = build_later  # runs a build off the streams' path (a worker, an idle child)
        self.cepstral_mean: str | None = None  # of the last finished utterance
        self._initial_cmn: str | None = None  # a fresh decoder's, for a reused one before any utterance
        self._idle: list = []  # decoders no stream holds, at most `keep`
        self._lock = threading.Lock()  # borrow and give_back run on several worker threads
        self._refilling = False  # a background build is queued or running

    def load(self) -> None:
        """Build the first `keep` decoders (fails here, at start-up, not in the first session)."""
        decoder = self.new_decoder()
        decoder.start_utt()
        decoder.end_utt()
        self._initial_cmn = decoder.get_cmn(False)
        self._idle = [decoder] + [self.new_decoder() for _ in range(self.keep - 1)]

    @property
    def idle(self) -> int:
        return len(self._idle)

    def new_decoder(self):
        from pocketsphinx import Decoder

        # lm=None: a grammar search never reads the general LM, which is two thirds of a decoder.
        # What end_utt runs is latency: the user has stopped and the reply waits for it
        # (bench/pocketsphinx_finish.py, on tests/turn_set.py). A grammar's lattice best path cost
        # 5 ms of CPU at p50 and 240 ms at worst, for worse words (word match 0.78, 0.81 without).
        # The general LM's flat second pass cost 180 ms at p50 for none better (0.37 with it and
        # the best path, 0.38 with the best path alone, at 38 ms): PocketsphinxConfig.second_pass.
        if self.grammar:
            options = {"lm": None, "bestpath": False}
        else:
            options = {"bestpath": True, "fwdflat": self.second_pass}
        decoder = Decoder(samprate=16000, loglevel="FATAL", **options)
        if self.grammar:
            decoder.add_jsgf_string("phrases", self.grammar)
            decoder.activate_search("phrases")
        if self.cepstral_mean:
            decoder.set_cmn(self.cepstral_mean)
        return decoder

    def borrow(self):
        """A decoder for a stream, as a new one would start."""
        with self._lock:
            decoder = self._idle.pop() if self._idle else None
            refill = decoder is None and not self._refilling  # more streams than the pool: one more
            self._refilling = self._refilling or refill
        if refill:
            self._build_later(self._refill)
        if decoder is None:
            return self.new_decoder()
        self.renew(decoder)
        return decoder

    def _refill(self) -> None:
        """One more idle decoder, built before a stream waits for it."""
        try:
            decoder = self.new_decoder()
        finally:
            with self._lock:
                self._refilling = False
        if not self._keep(decoder):  # streams gave theirs back meanwhile
            del decoder  # the last reference: the model is freed here
            release_freed_memory()

    def renew(self, decoder) -> None:
        """Start a decoder over as a new one would."""
        decoder.set_cmn(self.cepstral_mean or self._initial_cmn)  # its only state from earlier streams

    def give_back(self, transcriber: "Transcriber") -> None:
        """Take a stream's decoder back: kept idle for the next stream, or freed."""
        decoder, transcriber.decoder = transcriber.decoder, None
        if not self._keep(decoder):
            del decoder  # the last reference: the model is freed here
            release_freed_memory()

    def _keep(self, decoder) -> bool:
        """Whether the decoder was kept idle for the next stream (fewer than `keep` were)."""
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(decoder)
                return True
        return False

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()


class Transcriber:
    """One stream's decoding, on a decoder borrowed from the pool for the stream's life (blocking)."""

    def __init__(self, pool: Decoders) -> None:
        self.pool = pool
        self.decoder = pool.borrow()
        self._in_utterance = False
        self._partial = ""
        self._unsearched = 0  # samples fed since the last partial hypothesis

    def feed(self, pcm16: bytes) -> str | None:
        """16 kHz s16le audio of the current utterance; the partial transcript when it changed."""
        if not self._in_utterance:
            self.decoder.start_utt()
            self._in_utterance = True
            self._partial = ""
            self._unsearched = 0
        self.decoder.process_raw(pcm16, False, False)
        self._unsearched += len(pcm16) // 2
        if self._unsearched < PARTIAL_INTERVAL_SAMPLES:
            return None
        self._unsearched = 0
        hyp = self.decoder.hyp()
        text = hyp.hypstr if hyp else ""
        if text != self._partial:
            self._partial = text
            return text
        return None

    def finish(self) -> str:
        """The utterance's final transcript ("" for none); its cepstral mean becomes the pool's."""
        if not self._in_utterance:
            return ""
        self.decoder.end_utt()
        self._in_utterance = False
        self.pool.cepstral_mean = self.decoder.get_cmn(False)
        hyp = self.decoder.hyp()
        return hyp.hypstr if hyp else ""

    def renew(self) -> None:
        """The periodic reset: the decoder renewed in place, not given back (one given back may be
        freed, and the next utterance would build one: 0.3-0.6 s holding the GIL)."""
        if self._in_utterance:
            self.decoder.end_utt()
            self._in_utterance = False
        self.pool.renew(self.decoder)

    def close(self) -> None:
        """The decoder back to the pool (the stream's end)."""
        if self.decoder is None:
            return
        if self._in_utterance:
            self.decoder.end_utt()
            self._in_utterance = False
        self.pool.give_back(self)


# ---- the decoding process's side (voicebot/asr/pocketsphinx_process.py spawns it) --------------------

def _answer(pool: Decoders, streams: dict[int, Transcriber], request: tuple) -> Any:
    op, stream_id, argument = request
    if op == "batch":  # feeds of several streams: (partial, error) of each, in order
        return [_answer_one(pool, streams, feed) for feed in argument]
    if op == "feed":
        return streams[stream_id].feed(argument)
    if op == "finish":
        return streams[stream_id].finish(), pool.cepstral_mean
    if op in ("open", "renew") and argument:  # the server's last utterance's mean, whichever child
        pool.cepstral_mean = argument
    if op == "open":
        streams[stream_id] = Transcriber(pool)
    elif op == "renew":
        streams[stream_id].renew()
        return True
    elif op == "close":
        streams.pop(stream_id).close()
    else:
        raise ValueError(f"unknown request {op!r}")
    return None


def _answer_one(pool: Decoders, streams: dict[int, Transcriber], request: tuple) -> tuple[Any, str | None]:
    try:
        return _answer(pool, streams, request), None
    except Exception as exc:  # noqa: BLE001 -- this feed's failure, its stream's to report
        return None, f"{type(exc).__name__}: {exc}"


def serve(conn: Connection, phrases: list[str], second_pass: bool, keep: int) -> None:
    """The child's loop: answer the server's requests until its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    later: deque = deque()  # builds for the pool, run while no request waits (at most one: Decoders)
    pool = Decoders(phrases, second_pass, keep, later.append)
    try:
        pool.load()
    except Exception as exc:  # noqa: BLE001 -- told to the server, which fails its start-up with it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    streams: dict[int, Transcriber] = {}  # bound here; at most the server's sessions
    while True:
        while later and not conn.poll():
            later.popleft()()
        try:
            request = conn.recv()
        except EOFError:
            return  # the server is gone
        cpu = time.process_time()
        result, error = _answer_one(pool, streams, request)
        conn.send((result, error, time.process_time() - cpu))


if __name__ == "__main__":
    fd, options = sys.argv[1:3]
    serve(Connection(int(fd)), **json.loads(options))
