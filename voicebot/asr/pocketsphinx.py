"""pocketsphinx: English recognition that needs no downloads (its model ships in the wheel).

With `phrases` configured it decodes against a closed JSGF grammar of those phrases: deterministic,
for tests and demos. Without, it uses its general English language model: honest but weak
(20-35 % of words right on synthetic speech). Each stream holds a Decoder while it lives; calls
run on the engine's worker, but the binding holds the GIL for a whole call (a thread decoding 10 s
of audio in one call kept another from running for 2.4 s): the event loop waits out every call,
so each is kept short (a chunk at a time; no search after the utterance: `new_decoder`).

A Decoder is the model: about 90 MB with the general English LM (27 MB with a grammar, which needs
no LM) and 0.3 s of CPU to build, all of it holding the GIL: on a worker, it still stops the event
loop (bench/soak.py's stalls). Building one per session and freeing it at its end cost 90 MB of
RSS per concurrent session for good: glibc kept the freed pages (a server went from 385 MB to
1.29 GB after 10 sessions had come and gone, 1.53 GB after 20). So streams borrow decoders from
the recognizer and give them back. A pool of `pocketsphinx.decoders` is built at start-up, before
any session, so that a burst of sessions connecting at once builds none (10 at once built 10 and
stalled the loop 1.2-1.8 s). Given back, a decoder waits for the next stream while fewer than that
are idle; one more is freed and the memory returned to the system (`release_freed_memory`). So up
to that many streams at once build none; a stream that finds none idle builds its own and starts
one more building in the background for the next. Memory bound: max(decoders, streams open + 1)
decoders (27 MB each with a grammar, 90 MB with the general LM), at most `decoders` of them idle.
A periodic reset renews a stream's decoder in place.

pocketsphinx normalises features by a cepstral mean it learns from the audio it has decoded; a
cold decoder's first utterance is often cut short. New decoders start from the mean of the last
finished utterance of any session, so only the first utterance after start-up is decoded cold.
"""

from __future__ import annotations

import re
import threading

import numpy as np

from voicebot.asr.base import Hypothesis, Recognizer, RecognizerStream
from voicebot.config import PocketsphinxConfig
from voicebot.engine_reports import EngineInfo, ResetReport
from voicebot.memory import release_freed_memory
from voicebot.serving.worker import Worker

# A partial hypothesis (hyp(), the GIL held) at most once per this much audio: it only feeds the
# `asr.partial` a client displays, where 5 a second reads as live. After every 40 ms chunk, py-spy
# put it at 5 % of the server's busy CPU at 8 clients; bench/pocketsphinx_finish.py --partials
# measures 1 % of the decoding's CPU saved (0.4 ms per s of audio on a grammar, 4 ms on the
# general LM), the finals the same. The final is always exact: end_utt, then hyp().
PARTIAL_INTERVAL_SAMPLES = 3200  # 200 ms at 16 kHz


class PocketsphinxRecognizer(Recognizer):
    name = "pocketsphinx"

    def __init__(self, config: PocketsphinxConfig) -> None:
        self.config = config
        self.worker = Worker("pocketsphinx", threads=2)
        self._grammar: str | None = None
        self._loaded = False
        self.cepstral_mean: str | None = None  # of the last finished utterance
        self._initial_cmn: str | None = None  # a fresh decoder's, for a reused one before any utterance
        self._idle: list = []  # decoders no stream holds, at most config.decoders
        self._idle_lock = threading.Lock()  # borrow and give_back run on both worker threads
        self._refilling = False  # a background build is queued or running

    @property
    def model(self) -> str:
        return "pocketsphinx-en-us-grammar" if self._grammar else "pocketsphinx-en-us"

    def load(self) -> None:
        if self.config.phrases:
            self._grammar = self._jsgf(self.config.phrases)
        decoder = self.new_decoder()  # fail at start-up, not in the first session
        decoder.start_utt()
        decoder.end_utt()
        self._initial_cmn = decoder.get_cmn(False)
        self._idle = [decoder] + [self.new_decoder() for _ in range(self.config.decoders - 1)]
        self._loaded = True

    def new_decoder(self):
        from pocketsphinx import Decoder

        # lm=None: a grammar search never reads the general LM, which is two thirds of a decoder.
        # What end_utt runs is latency: the user has stopped and the reply waits for it
        # (bench/pocketsphinx_finish.py, on tests/turn_set.py). A grammar's lattice best path cost
        # 5 ms of CPU at p50 and 240 ms at worst, for worse words (word match 0.78, 0.81 without).
        # The general LM's flat second pass cost 180 ms at p50 for none better (0.37 with it and
        # the best path, 0.38 with the best path alone, at 38 ms): PocketsphinxConfig.second_pass.
        if self._grammar:
            options = {"lm": None, "bestpath": False}
        else:
            options = {"bestpath": True, "fwdflat": self.config.second_pass}
        decoder = Decoder(samprate=16000, loglevel="FATAL", **options)
        if self._grammar:
            decoder.add_jsgf_string("phrases", self._grammar)
            decoder.activate_search("phrases")
        if self.cepstral_mean:
            decoder.set_cmn(self.cepstral_mean)
        return decoder

    def borrow(self):
        """A decoder for a stream, as a new one would start (blocking: runs on the worker)."""
        with self._idle_lock:
            decoder = self._idle.pop() if self._idle else None
            refill = decoder is None and not self._refilling  # more streams than the pool: one more
            self._refilling = self._refilling or refill
        if refill:
            self.worker.submit(self._refill)
        if decoder is None:
            return self.new_decoder()
        self.renew(decoder)
        return decoder

    def _refill(self) -> None:
        """One more idle decoder, built before a stream waits for it (blocking: runs on the worker)."""
        try:
            decoder = self.new_decoder()
        finally:
            with self._idle_lock:
                self._refilling = False
        if not self._keep(decoder):  # streams gave theirs back meanwhile
            del decoder  # the last reference: the model is freed here
            release_freed_memory()

    def renew(self, decoder) -> None:
        """Start a decoder over as a new one would (blocking: runs on the worker)."""
        decoder.set_cmn(self.cepstral_mean or self._initial_cmn)  # its only state from earlier streams

    def give_back(self, stream: "PocketsphinxStream") -> None:
        """Take the stream's decoder back: kept idle, or freed (blocking: runs on the worker)."""
        decoder, stream._decoder = stream._decoder, None
        if decoder is None:
            return
        if stream._in_utterance:
            decoder.end_utt()
            stream._in_utterance = False
        if not self._keep(decoder):
            del decoder  # the last reference: the model is freed here
            release_freed_memory()

    def _keep(self, decoder) -> bool:
        """Whether the decoder was kept idle for the next stream (fewer than config.decoders were)."""
        with self._idle_lock:
            if len(self._idle) < self.config.decoders:
                self._idle.append(decoder)
                return True
        return False

    @staticmethod
    def _jsgf(phrases: list[str]) -> str:
        words = [re.sub(r"[^a-z' ]", " ", p.lower()).split() for p in phrases]
        alternatives = " | ".join(" ".join(w) for w in words if w)
        return f"#JSGF V1.0;\ngrammar phrases;\npublic <utterance> = {alternatives};\n"

    def open(self, language: str | None = None) -> "PocketsphinxStream":
        return PocketsphinxStream(self)

    def info(self) -> EngineInfo:
        return EngineInfo("asr", self.name, "cpu", self._loaded, {"model": self.model, "phrases": len(self.config.phrases)})

    def workers(self) -> list[Worker]:
        return [self.worker]

    def close(self) -> None:
        self.worker.shutdown()
        self._idle.clear()


class PocketsphinxStream(RecognizerStream):
    def __init__(self, engine: PocketsphinxRecognizer) -> None:
        self.engine = engine
        # Building a Decoder reads the acoustic model (~0.3 s) if none is idle: start now, off the loop.
        self._decoder_future = engine.worker.submit(engine.borrow)
        self._decoder = None
        self._in_utterance = False
        self._partial = ""
        self._unsearched = 0  # samples fed since the last partial hypothesis
        self.generation = 0

    def _accept(self, pcm: np.ndarray) -> str | None:
        if self._decoder is None:
            self._decoder = self._decoder_future.result() if self._decoder_future else self.engine.borrow()
            self._decoder_future = None
        if not self._in_utterance:
            self._decoder.start_utt()
            self._in_utterance = True
            self._partial = ""
            self._unsearched = 0
        self._decoder.process_raw((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes(), False, False)
        self._unsearched += len(pcm)
        if self._unsearched < PARTIAL_INTERVAL_SAMPLES:
            return None
        self._unsearched = 0
        hyp = self._decoder.hyp()
        text = hyp.hypstr if hyp else ""
        if text != self._partial:
            self._partial = text
            return text
        return None

    def _finish(self) -> Hypothesis:
        if not self._in_utterance:
            return Hypothesis("", None, self.engine.model)
        self._decoder.end_utt()
        self._in_utterance = False
        self.engine.cepstral_mean = self._decoder.get_cmn(False)
        hyp = self._decoder.hyp()
        if hyp is None:
            return Hypothesis("", None, self.engine.model)
        # pocketsphinx's posterior needs a lattice it does not build in streaming mode (it always
        # reads 1.0): report no confidence rather than a meaningless one.
        return Hypothesis(hyp.hypstr, None, self.engine.model, token_count=len(hyp.hypstr.split()))

    async def accept(self, pcm: np.ndarray) -> str | None:
        return await self.engine.worker.run(self._accept, pcm)

    async def finish(self) -> Hypothesis:
        return await self.engine.worker.run(self._finish)

    async def reset(self) -> ResetReport:
        had_decoder = self._decoder is not None
        # Renewed in place, not given back: one given back may be freed, and the next utterance would
        # build one, which keeps the GIL, and so every thread and the event loop, for 0.3-0.6 s.
        await self.engine.worker.run(self._renew)
        self.generation += 1
        return ResetReport(self.engine.name, self.generation, 1 if had_decoder else 0)

    async def close(self) -> None:
        await self.engine.worker.run(self._give_back)

    def _renew(self) -> None:
        if self._decoder is None:  # none borrowed yet, or the one borrowed at open never used: as new
            return
        if self._in_utterance:
            self._decoder.end_utt()
            self._in_utterance = False
        self.engine.renew(self._decoder)

    def _give_back(self) -> None:
        if self._decoder_future is not None:  # borrowed at open, never used
            self._decoder, self._decoder_future = self._decoder_future.result(), None
        self.engine.give_back(self)
