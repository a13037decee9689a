"""Streaming Chinese recognition with FunASR's Paraformer (`asr.engine: paraformer`, and
`paraformer-batched`: the same sessions with the streaming models on voicebot/asr/sanm, batched).

Each session's stream owns a funasr cache dict; the model and its single worker thread are
shared. Partials are emitted after every decode step (600 ms of audio with chunk [0, 10, 5]).
At each endpoint `finish` flushes the stream with `is_final`, which re-initialises the cache, so
no stream's state outlives its utterance; with the encoder/decoder look-back bounded by the
config, a stream's state is bounded by construction (tests/asr/test_bounded_state.py measures it).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import yaml

from voicebot.asr.base import SAMPLE_RATE, Hypothesis, Recognizer, RecognizerStream
from voicebot.asr.fsmn_vad import FsmnVad
from voicebot.asr.funasr_model import Decoded, FunasrModel, state_bytes
from voicebot.asr.punctuation import Punctuator
from voicebot.asr.router import Router, to_hypothesis
from voicebot.asr.sanm.engine import BatchedStreamingModel
from voicebot.asr.sanm.model import ChunkConfig
from voicebot.config.engines import ParaformerConfig
from voicebot.config.stages import EndpointConfig
from voicebot.engine_reports import EngineInfo, ResetReport
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
        # fsmn-vad for /funasr (voicebot.frontends.funasr_ws), when asr.paraformer.vad_model is set.
        self.vad: FsmnVad | None = None
        self.punctuator: Punctuator | None = None  # asr.paraformer.punc_model: punctuates each final

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
                         ("asr.paraformer.vad_model", conf.vad_model),
                         ("asr.paraformer.punc_model", conf.punc_model)):
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
            parallel=conf.dialect.parallel,
        )
        if conf.vad_model:
            self.vad = FsmnVad(resolve(ModelRef("asr.paraformer.vad_model", conf.vad_model, conf.model_cache)),
                               conf.device, conf.threads, self.endpoint.endpoint_silence_ms)
            self.vad.load()
        if conf.punc_model:
            self.punctuator = Punctuator("asr.paraformer.punc_model",
                                         resolve(ModelRef("asr.paraformer.punc_model", conf.punc_model, conf.model_cache)),
                                         conf.device, conf.threads)
            self.punctuator.load()

    def open(self, language: str | None = None) -> ParaformerStream:
        if self.streaming is None:
            raise RuntimeError("ParaformerRecognizer.open() before load()")
        return ParaformerStream(self)

    def info(self) -> EngineInfo:
        models = {m.name: str(m.path) for m in (self.streaming, self.router.offline, self.router.dialect, self.punctuator) if m}
        return EngineInfo(
            kind="asr",
            name=self.name,
            device=self.config.device,
            loaded=self.streaming is not None,
            details={
                "models": models,
                "chunk_size": list(self.config.chunk_size),
                "fallback_threshold": self.config.dialect.fallback_threshold,
                "pending": {m.name: m.worker.pending
                            for m in (self.streaming, self.router.offline, self.router.dialect, self.punctuator) if m},
            },
        )

    def close(self) -> None:
        for model in (self.streaming, self.router.offline, self.router.dialect, self.vad, self.punctuator):
            if model is not None:
                model.close()


class BatchedParaformerRecognizer(ParaformerRecognizer):
    """`asr.engine: paraformer-batched`: the same sessions, second pass and fallback, but every
    streaming-class model (the primary, and a streaming dialect model) is our own implementation
    (voicebot/asr/sanm) with one ParaformerBatcher each: all sessions' chunks in one model call per
    step. Offline-class models (the second pass, an offline dialect model) still run in funasr."""

    name = "paraformer-batched"

    def _model(self, key: str, ref: str) -> FunasrModel | BatchedStreamingModel:
        path = resolve(ModelRef(key, ref, self.config.model_cache))
        model_class = (yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}).get("model")
        if model_class != "ParaformerStreaming":
            return super()._model(key, ref)
        conf = self.config
        chunk = ChunkConfig(tuple(conf.chunk_size), conf.encoder_look_back, conf.decoder_look_back)
        model = BatchedStreamingModel(key, path, chunk, conf.device, conf.dtype, conf.threads, conf.max_batch)
        model.load()
        return model

    def workers(self) -> list:
        """The batchers, for admission control: each reports its thread's busy seconds like a Worker."""
        models = (self.streaming, self.router.dialect)
        return [m.worker for m in models if isinstance(m, BatchedStreamingModel)]

    def info(self) -> EngineInfo:
        """As the funasr engine's, plus each batcher's counts (/readyz): rows per step, refusals,
        cancellations, failed requests, thread faults."""
        info = super().info()
        info.details["batchers"] = {batcher.name: batcher.stats() for batcher in self.workers()}
        return info


class StreamingPass:
    """One streaming model's pass over the current utterance: its cache, text and confidences."""

    def __init__(self, model: FunasrModel) -> None:
        self.model = model
        self.clear()

    def clear(self) -> None:
        self.cache: dict = {}
        self.text = ""
        self.confidences: list[float] = []

    async def feed(self, pcm: np.ndarray) -> bool:
        """Decode what `pcm` completes; True when the text grew."""
        delta = await self.model.stream(self.cache, pcm, False)
        self.confidences += delta.token_confidences
        self.text += delta.text
        return bool(delta.text)

    async def flush(self) -> Decoded:
        """The utterance's whole result; the pass is empty again afterwards."""
        tail = await self.model.stream(self.cache, np.zeros(0, dtype=np.float32), True)
        decoded = Decoded(self.text + tail.text, self.confidences + tail.token_confidences)
        self.clear()
        return decoded


class ParaformerStream(RecognizerStream):
    def __init__(self, recognizer: ParaformerRecognizer) -> None:
        assert recognizer.streaming is not None
        self._router = recognizer.router
        self._punctuator = recognizer.punctuator
        self._primary = StreamingPass(recognizer.streaming)
        # With dialect.parallel the dialect model streams the same audio on its own worker.
        self._dialect = StreamingPass(self._router.dialect) if self._router.parallel else None
        self._passes = [p for p in (self._primary, self._dialect) if p is not None]
        self._max_samples = recognizer.max_utterance_samples
        self._generation = 0
        self._clear_audio()

    def _clear_audio(self) -> None:
        self._audio: list[np.ndarray] = []
        self._kept = 0

    def state_bytes(self) -> int:
        return sum(state_bytes(p.cache) for p in self._passes) + sum(a.nbytes for a in self._audio)

    async def accept(self, pcm: np.ndarray) -> str | None:
        pcm = np.asarray(pcm, dtype=np.float32)
        if self._router.needs_audio and self._kept + len(pcm) <= self._max_samples:
            self._audio.append(pcm)
            self._kept += len(pcm)
        grew, *_ = await asyncio.gather(*(p.feed(pcm) for p in self._passes))
        return self._primary.text if grew else None

    async def finish(self) -> Hypothesis:
        primary, *dialect = await asyncio.gather(*(p.flush() for p in self._passes))
        audio = np.concatenate(self._audio) if self._audio else None
        self._clear_audio()
        hypothesis = to_hypothesis(primary, self._primary.model.name)
        if not (self._router.needs_audio and audio is None):  # else nothing was heard: nothing to re-decode
            hypothesis = await self._router.finalize(hypothesis, audio, dialect[0] if dialect else None)
        if self._punctuator is not None and hypothesis.text:
            hypothesis = replace(hypothesis, text=await self._punctuator.punctuate(hypothesis.text))
        return hypothesis

    async def reset(self) -> ResetReport:
        freed = self.state_bytes()
        await self.close()
        self._generation += 1
        return ResetReport(engine="paraformer", generation=self._generation, bytes_freed=freed)

    async def close(self) -> None:
        for streaming_pass in self._passes:
            streaming_pass.clear()
        self._clear_audio()
