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
and the memory returned to the system (`release_freed_memory`).

A stream that finds none idle, where the pool lives:
- on the server's threads (`build_later` given): builds its own, and has one more built later, on
  a worker, for the next. Memory bound: max(keep, streams open + 1) decoders, at most `keep` idle.
- in a decoding process (`serve`): a build holds the child for 0.2-0.6 s, and every stream bound
  there waits behind it, so none runs inside a request unless that request cannot be answered
  without it. The stream's open is answered at once, and it waits for its decoder, its audio held
  (`MAX_HELD_BYTES`); between requests, while none waits, the child builds one decoder at a time,
  for the oldest waiting stream. The server has one request in flight per child, so each request
  waits behind at most one build between requests, and one inside it (a waiting stream's finish,
  or its feed past the hold). The builds still take the child's CPU from its streams (pocketsphinx
  holds the GIL throughout; a build in another thread would hold it too): a burst of streams
  beyond the pool delays the child's other streams by every build it needs, one after another
  (bench/pocketsphinx_burst.py --joining). So the server lets a stream in that needs a build only
  while none of the child's streams is speaking (PocketsphinxRecognizer.full), and the child keeps
  what it built: `keep` grows to the most streams bound to it at once, and a decoder given back
  stays idle, so each build is paid once per new peak, not at every burst. Each answer tells the
  server the decoders built since the last (its count of the child's idle ones).
  Memory bound: max(keep at start-up, the most streams bound to the child at once) decoders, all
  kept (the server's `max_sessions` bounds the streams).

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
from multiprocessing.connection import Connection
from typing import Any, Callable

from voicebot.memory import release_freed_memory

# A partial hypothesis (hyp(), the GIL held) at most once per this much audio: it only feeds the
# `asr.partial` a client displays, where 5 a second reads as live. After every 40 ms chunk, py-spy
# put it at 5 % of the server's busy CPU at 8 clients; bench/pocketsphinx_finish.py --partials
# measures 1 % of the decoding's CPU saved (0.4 ms per s of audio on a grammar, 4 ms on the
# general LM), the finals the same. The final is always exact: end_utt, then hyp().
PARTIAL_INTERVAL_SAMPLES = 3200  # 200 ms at 16 kHz
# The most audio a stream waiting for its decoder has held for it (10 s of s16le, 320 KB: a child's
# builds between requests reach a stream well within it); past it, its feed builds the decoder itself.
MAX_HELD_BYTES = 10 * 2 * 16000


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
                 build_later: Callable[[Callable[[], None]], object] | None) -> None:
        self.grammar = jsgf(phrases) if phrases else None
        self.second_pass = second_pass
        self.keep = keep
        # Runs a build off the streams' path (a worker); None: the owner builds for the streams waiting (`serve`).
        self._build_later = build_later
        self.cepstral_mean: str | None = None  # of the last finished utterance
        self._initial_cmn: str | None = None  # a fresh decoder's, for a reused one before any utterance
        self._idle: list = []  # decoders no stream holds, at most `keep`
        self._lock = threading.Lock()  # borrow and give_back run on several worker threads
        self._refilling = False  # a background build is queued or running
        self.built = 0  # decoders built, the start-up's included

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
        self.built += 1
        return decoder

    def borrow(self):
        """A decoder for a stream, as a new one would start: an idle one, else one built now (and,
        on the server's threads, one more later for the next stream)."""
        decoder = self.take_idle()
        if decoder is not None:
            return decoder
        if self._build_later is not None:
            with self._lock:
                refill, self._refilling = not self._refilling, True
            if refill:
                self._build_later(self._refill)
        return self.new_decoder()

    def take_idle(self):
        """An idle decoder, renewed, or None (nothing is built)."""
        with self._lock:
            decoder = self._idle.pop() if self._idle else None
        if decoder is not None:
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
    """One stream's decoding, on a decoder borrowed from the pool for the stream's life (blocking).

    `decoder` None: the stream waits for one (`attach`), its utterance's audio held meanwhile, at
    most MAX_HELD_BYTES of it; a feed past that, or the utterance's finish, borrows one at once."""

    def __init__(self, pool: Decoders, decoder) -> None:
        self.pool = pool
        self.decoder = decoder
        self._held = bytearray()  # the utterance's audio while no decoder is attached
        self._in_utterance = False
        self._partial = ""
        self._unsearched = 0  # samples fed since the last partial hypothesis

    @classmethod
    def borrowing(cls, pool: Decoders) -> "Transcriber":
        """A stream with a decoder of its own from the start (built now if none is idle)."""
        return cls(pool, pool.borrow())

    def attach(self, decoder) -> None:
        """The stream's decoder, at last: the audio held for it decoded on it."""
        self.decoder = decoder
        if self._in_utterance:
            decoder.start_utt()
            if self._held:
                decoder.process_raw(bytes(self._held), False, False)
                self._unsearched += len(self._held) // 2  # the next feed searches it for a partial
        self._held = bytearray()

    def feed(self, pcm16: bytes) -> str | None:
        """16 kHz s16le audio of the current utterance; the partial transcript when it changed."""
        if not self._in_utterance:
            self._in_utterance = True
            self._partial = ""
            self._unsearched = 0
            if self.decoder is not None:
                self.decoder.start_utt()
        if self.decoder is None:
            if len(self._held) + len(pcm16) <= MAX_HELD_BYTES:
                self._held += pcm16
                return None
            self.attach(self.pool.borrow())
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
        if self.decoder is None:  # the reply waits for this transcript: its decoder now
            self.attach(self.pool.borrow())
        self.decoder.end_utt()
        self._in_utterance = False
        self.pool.cepstral_mean = self.decoder.get_cmn(False)
        hyp = self.decoder.hyp()
        return hyp.hypstr if hyp else ""

    def renew(self) -> None:
        """The periodic reset: the decoder renewed in place, not given back (one given back may be
        freed, and the next utterance would build one: 0.3-0.6 s holding the GIL). The utterance in
        progress is dropped, held audio with it."""
        if self._in_utterance and self.decoder is not None:
            self.decoder.end_utt()
        self._in_utterance = False
        self._held = bytearray()
        if self.decoder is not None:
            self.pool.renew(self.decoder)

    def close(self) -> None:
        """The decoder back to the pool (the stream's end)."""
        self._held = bytearray()
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
    if op == "open":  # nothing built here: a stream with no decoder waits for one (`serve`)
        streams[stream_id] = Transcriber(pool, pool.take_idle())
        pool.keep = max(pool.keep, len(streams))  # what is built for the peak is kept for the next one
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
    pool = Decoders(phrases, second_pass, keep, build_later=None)  # builds between requests: build_one
    try:
        pool.load()
    except Exception as exc:  # noqa: BLE001 -- told to the server, which fails its start-up with it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    streams: dict[int, Transcriber] = {}  # bound here, oldest first; at most the server's sessions
    reported = pool.built  # builds told to the server: each answer tells those since the last
    while True:
        while not conn.poll() and build_one(streams):
            pass
        try:
            request = conn.recv()
        except EOFError:
            return  # the server is gone
        cpu = time.process_time()
        result, error = _answer_one(pool, streams, request)
        conn.send((result, error, time.process_time() - cpu, pool.built - reported))
        reported = pool.built


def build_one(streams: dict[int, Transcriber]) -> bool:
    """A decoder for the oldest stream waiting for one (an idle one if a stream gave one back
    meanwhile); whether one was waiting."""
    waiting = next((stream for stream in streams.values() if stream.decoder is None), None)
    if waiting is None:
        return False
    waiting.attach(waiting.pool.borrow())
    return True


if __name__ == "__main__":
    fd, options = sys.argv[1:3]
    serve(Connection(int(fd)), **json.loads(options))
