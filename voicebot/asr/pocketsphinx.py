"""pocketsphinx: English recognition that needs no downloads (its model ships in the wheel).

With `phrases` configured it decodes against a closed JSGF grammar of those phrases: deterministic,
for tests and demos. Without, it uses its general English language model: honest but weak
(20-35 % of words right on synthetic speech). Each stream owns a Decoder; calls run on the
engine's worker so the event loop never waits for the decoder.

pocketsphinx normalises features by a cepstral mean it learns from the audio it has decoded; a
cold decoder's first utterance is often cut short. New decoders start from the mean of the last
finished utterance of any session, so only the first utterance after start-up is decoded cold.
"""

from __future__ import annotations

import re

import numpy as np

from voicebot.asr.base import Hypothesis, Recognizer, RecognizerStream
from voicebot.config import PocketsphinxConfig
from voicebot.engine_reports import EngineInfo, ResetReport
from voicebot.serving.worker import Worker

class PocketsphinxRecognizer(Recognizer):
    name = "pocketsphinx"

    def __init__(self, config: PocketsphinxConfig) -> None:
        self.config = config
        self.worker = Worker("pocketsphinx", threads=2)
        self._grammar: str | None = None
        self._loaded = False
        self.cepstral_mean: str | None = None  # of the last finished utterance

    @property
    def model(self) -> str:
        return "pocketsphinx-en-us-grammar" if self._grammar else "pocketsphinx-en-us"

    def load(self) -> None:
        if self.config.phrases:
            self._grammar = self._jsgf(self.config.phrases)
        self.new_decoder().start_utt()  # fail at start-up, not in the first session
        self._loaded = True

    def new_decoder(self):
        from pocketsphinx import Decoder

        decoder = Decoder(samprate=16000, loglevel="FATAL", bestpath=True)
        if self._grammar:
            decoder.add_jsgf_string("phrases", self._grammar)
            decoder.activate_search("phrases")
        if self.cepstral_mean:
            decoder.set_cmn(self.cepstral_mean)
        return decoder

    @staticmethod
    def _jsgf(phrases: list[str]) -> str:
        words = [re.sub(r"[^a-z' ]", " ", p.lower()).split() for p in phrases]
        alternatives = " | ".join(" ".join(w) for w in words if w)
        return f"#JSGF V1.0;\ngrammar phrases;\npublic <utterance> = {alternatives};\n"

    def open(self, language: str | None = None) -> "PocketsphinxStream":
        return PocketsphinxStream(self)

    def info(self) -> EngineInfo:
        return EngineInfo("asr", self.name, "cpu", self._loaded, {"model": self.model, "phrases": len(self.config.phrases)})

    def close(self) -> None:
        self.worker.shutdown()


class PocketsphinxStream(RecognizerStream):
    def __init__(self, engine: PocketsphinxRecognizer) -> None:
        self.engine = engine
        # Building a Decoder reads the acoustic model (~0.3 s): start it now, off the loop.
        self._decoder_future = engine.worker.submit(engine.new_decoder)
        self._decoder = None
        self._in_utterance = False
        self._partial = ""
        self.generation = 0

    def _accept(self, pcm: np.ndarray) -> str | None:
        if self._decoder is None:
            self._decoder = self._decoder_future.result() if self._decoder_future else self.engine.new_decoder()
            self._decoder_future = None
        if not self._in_utterance:
            self._decoder.start_utt()
            self._in_utterance = True
            self._partial = ""
        self._decoder.process_raw((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes(), False, False)
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
        def drop() -> None:
            if self._in_utterance:
                self._decoder.end_utt()
            self._decoder = None  # a fresh Decoder (and its adaptation state) on the next utterance
            self._decoder_future = None
            self._in_utterance = False

        had_decoder = self._decoder is not None
        await self.engine.worker.run(drop)
        self.generation += 1
        return ResetReport(self.engine.name, self.generation, 1 if had_decoder else 0)

    async def close(self) -> None:
        self._decoder = self._decoder_future = None
