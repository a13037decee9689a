"""Streaming Chinese recognition with FunASR's Paraformer (`asr.engine: paraformer`).

Each session's stream owns a funasr cache dict; the model and its single worker thread are
shared. Partials are emitted after every decode step (600 ms of audio with chunk [0, 10, 5]).
At each endpoint `finish` flushes the stream with `is_final`, which re-initialises the cache, so
no stream's state outlives its utterance; with the encoder/decoder look-back bounded by the
config, a stream's state is bounded by construction (tests/asr/test_bounded_state.py measures it).
"""

from __future__ import annotations

import numpy as np

from voicebot.asr.base import SAMPLE_RATE, Hypothesis, Recognizer, RecognizerStream
from voicebot.asr.fsmn_vad import FsmnVad
from voicebot.asr.funasr_model import Decoded, FunasrModel, state_bytes
from voicebot.asr.router import Router, to_hypothesis
from voicebot.config import EndpointConfig, ParaformerConfig
from voicebot.engine import EngineInfo, ResetReport
from voicebot.models import ModelRef, resolve


class ParaformerRecognizer(Recognizer):
    name = "paraformer"

    def __init__(self, config: ParaformerConfig, endpoint: EndpointConfig | None = None) -> None:
        self.config = config
        self.endpoint = endpoint or EndpointConfig()
        # Audio kept per utterance for the second pass; the endpointer cuts utterances at this
        # length, so more than this is never needed (and never kept).
        self.max_utterance_samples = int(self.endpoint.max_utterance_s * SAMPLE_RATE)
        self.streaming: FunasrModel | None = None
        self.router = Router()
        # fsmn-vad for /funasr (voicebot.asr.funasr_ws), when asr.paraformer.vad_model is set.
        self.vad: FsmnVad | None = None

    def _model(self, key: str, ref: str) -> FunasrModel:
        path = resolve(ModelRef(key, ref, self.config.model_cache))
        stream_options = {
            "chunk_size": list(self.config.chunk_size),
            "encoder_chunk_look_back": self.config.encoder_look_back,
            "decoder_chunk_look_back": self.config.decoder_look_back,
        }
        model = FunasrModel(key, path, self.config.device, self.config.threads, stream_options)
        model.load()
        return model

    def load(self) -> None:
        conf = self.config
        # Resolve every model before loading any, so a missing one fails start-up in seconds.
        for key, ref in (("asr.paraformer.model", conf.model),
                         ("asr.paraformer.offline_model", conf.offline_model),
                         ("asr.paraformer.dialect.model", conf.dialect.model),
                         ("asr.paraformer.vad_model", conf.vad_model)):
            if ref:
                resolve(ModelRef(key, ref, conf.model_cache))
        self.streaming = self._model("asr.paraformer.model", conf.model)
        if not self.streaming.streaming:
            raise ValueError(f"asr.paraformer.model = {conf.model!r} is a {self.streaming.class_name}, not a streaming Paraformer")
        self.router = Router(
            offline=self._model("asr.paraformer.offline_model", conf.offline_model) if conf.offline_model else None,
            dialect=self._model("asr.paraformer.dialect.model", conf.dialect.model) if conf.dialect.model else None,
            threshold=conf.dialect.fallback_threshold,
            prefer=conf.dialect.prefer,
        )
        if conf.vad_model:
            self.vad = FsmnVad(resolve(ModelRef("asr.paraformer.vad_model", conf.vad_model, conf.model_cache)),
                               conf.device, conf.threads, self.endpoint.endpoint_silence_ms)
            self.vad.load()

    def open(self, language: str | None = None) -> ParaformerStream:
        if self.streaming is None:
            raise RuntimeError("ParaformerRecognizer.open() before load()")
        return ParaformerStream(self)

    def info(self) -> EngineInfo:
        models = {m.name: str(m.path) for m in (self.streaming, self.router.offline, self.router.dialect) if m}
        return EngineInfo(
            kind="asr",
            name=self.name,
            device=self.config.device,
            loaded=self.streaming is not None,
            details={
                "models": models,
                "chunk_size": list(self.config.chunk_size),
                "fallback_threshold": self.config.dialect.fallback_threshold,
                "pending": {m.name: m.worker.pending for m in (self.streaming, self.router.offline, self.router.dialect) if m},
            },
        )

    def close(self) -> None:
        for model in (self.streaming, self.router.offline, self.router.dialect, self.vad):
            if model is not None:
                model.close()


class ParaformerStream(RecognizerStream):
    def __init__(self, recognizer: ParaformerRecognizer) -> None:
        assert recognizer.streaming is not None
        self._model = recognizer.streaming
        self._router = recognizer.router
        self._max_samples = recognizer.max_utterance_samples
        self._generation = 0
        self._new_utterance()

    def _new_utterance(self) -> None:
        self._cache: dict = {}
        self._text = ""
        self._confidences: list[float] = []
        self._audio: list[np.ndarray] = []
        self._kept = 0

    def state_bytes(self) -> int:
        return state_bytes(self._cache) + sum(a.nbytes for a in self._audio)

    async def accept(self, pcm: np.ndarray) -> str | None:
        pcm = np.asarray(pcm, dtype=np.float32)
        if self._router.needs_audio and self._kept + len(pcm) <= self._max_samples:
            self._audio.append(pcm)
            self._kept += len(pcm)
        delta = await self._model.stream(self._cache, pcm, False)
        self._confidences += delta.token_confidences
        if not delta.text:
            return None
        self._text += delta.text
        return self._text

    async def finish(self) -> Hypothesis:
        tail = await self._model.stream(self._cache, np.zeros(0, dtype=np.float32), True)
        decoded = Decoded(self._text + tail.text, self._confidences + tail.token_confidences)
        audio = self._audio
        self._new_utterance()
        hypothesis = to_hypothesis(decoded, self._model.name)
        if not audio or not self._router.needs_audio:
            return hypothesis
        return await self._router.finalize(hypothesis, np.concatenate(audio))

    async def reset(self) -> ResetReport:
        freed = self.state_bytes()
        self._new_utterance()
        self._generation += 1
        return ResetReport(engine="paraformer", generation=self._generation, bytes_freed=freed)

    async def close(self) -> None:
        self._new_utterance()
