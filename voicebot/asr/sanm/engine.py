"""Our batched streaming Paraformer behind the interface the Paraformer engine drives.

`BatchedStreamingModel` offers what voicebot/asr/paraformer.py's StreamingPass and the Router
call on a FunasrModel (`stream`, `decode`, `name`, `path`, `streaming`, `worker.pending`,
`close`), so the `paraformer-batched` engine reuses the funasr engine's sessions, second pass and
dialect fallback unchanged; only where streaming-class models run differs: every session's chunk
goes through one ParaformerBatcher, one model call per step, instead of one funasr call each.

A pass's `cache` dict (StreamingPass makes a fresh one per utterance) holds the session's
ParaformerStream under one key; `state_bytes` reads its `nbytes`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch

from voicebot.asr.funasr_model import Decoded as FunasrDecoded
from voicebot.asr.sanm.batcher import ParaformerBatcher
from voicebot.asr.sanm.loader import load_paraformer
from voicebot.asr.sanm.model import ChunkConfig
from voicebot.asr.sanm.stream import UNSPOKEN, Decoded, ParaformerStream, StreamingParaformer

log = logging.getLogger(__name__)

_STREAM_KEY = "stream"


class BatchedStreamingModel:
    streaming = True
    class_name = "ParaformerStreaming"

    def __init__(self, name: str, path: Path, chunk: ChunkConfig, device: str = "cpu", dtype: str = "float32",
                 threads: int = 1, max_batch: int = 32) -> None:
        self.name = name
        self.path = Path(path)
        self.chunk = chunk
        self.device = device
        self.dtype = dtype
        self.threads = threads
        self.max_batch = max_batch
        self.engine: StreamingParaformer | None = None
        self.batcher: ParaformerBatcher | None = None

    def load(self) -> None:
        """Blocking: load the directory (its checkpoint matched key by key) and start the batcher."""
        torch.set_num_threads(self.threads)
        loaded = load_paraformer(self.path, device=self.device, dtype=getattr(torch, self.dtype))
        self.engine = StreamingParaformer(loaded, self.chunk)
        self.batcher = ParaformerBatcher(self.engine, max_batch=self.max_batch, name=self.name)
        self.batcher.start()
        log.info("loaded %s (our batched ParaformerStreaming, %s %s) from %s", self.name, self.device, self.dtype, self.path)

    @property
    def worker(self) -> ParaformerBatcher:
        assert self.batcher is not None, "load() first"
        return self.batcher

    def _stream(self, cache: dict) -> ParaformerStream:
        if _STREAM_KEY not in cache:
            assert self.engine is not None, "load() first"
            cache[_STREAM_KEY] = self.engine.open()
        return cache[_STREAM_KEY]

    @staticmethod
    def _decoded(result: Decoded) -> FunasrDecoded:
        confidences = [math.exp(p) for t, p in zip(result.tokens, result.token_logprobs) if t not in UNSPOKEN]
        return FunasrDecoded(result.text, confidences)

    async def stream(self, cache: dict, audio: np.ndarray, is_final: bool) -> FunasrDecoded:
        """The text `audio` completes on the pass whose state `cache` holds (funasr's deltas)."""
        return self._decoded(await self.worker.feed(self._stream(cache), audio, is_final))

    async def decode(self, audio: np.ndarray) -> FunasrDecoded:
        """One whole utterance, as a final piece on a fresh stream."""
        return await self.stream({}, audio, True)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.stop()
        self.engine = None
