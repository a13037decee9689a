"""Every session's streaming Paraformer chunks in one model call per step, on a thread of its own.

Sessions submit audio for their stream (`submit`, `feed`) and await the tokens it produced; one
thread runs the model (voicebot/serving/batcher.py: the steps, bounds, counts and failures every
batcher shares). A stream's pieces are sequential (its caches carry from one to the next), so a
step takes the next piece (one chunk stride, 600 ms for [0, 10, 5]) of each stream waiting, in one
`StreamingParaformer.step`: one encoder call and one decoder call for all of them. Each stream keeps
its own state, so its tokens do not depend on who else is in the batch (tests/asr/test_sanm_batch.py).

The front end (fbank, LFR, CMVN) of a request runs on this thread when the request is taken, not on
the caller's (the event loop's) thread.

Bounds: at most `max_pending` requests (1024) waiting or running, one per stream, each holding the
audio of one call; `submit` raises `AsrOverloaded` past it. A step takes at most `max_batch` rows,
oldest first. A request that fails (its step with `StepFailed`, its front end, or a break of the
loop with `AsrBatcherFault`) resets its stream: the utterance so far is lost, and the stream's next
request starts a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field

import numpy as np

from voicebot.asr.sanm.stream import Decoded, ParaformerStream, Piece, StreamingParaformer
from voicebot.serving.batcher import BatcherFault, BatcherOverloaded, StepBatcher


class AsrOverloaded(BatcherOverloaded):
    """More recognition requests are waiting than the batcher's bound."""


class AsrBatcherFault(BatcherFault):
    """The batcher's loop was broken while it held this request; the loop goes on."""


@dataclass(eq=False)
class _Audio:
    stream: ParaformerStream
    audio: np.ndarray
    is_final: bool
    pieces: list[Piece] = field(default_factory=list)  # cut when taken; the next one is stepped
    result: Decoded = field(default_factory=Decoded)


class ParaformerBatcher(StepBatcher[_Audio]):
    overloaded = AsrOverloaded
    fault = AsrBatcherFault

    def __init__(self, engine: StreamingParaformer, max_batch: int = 32, max_pending: int = 1024,
                 name: str = "asr") -> None:
        super().__init__(name, max_batch, max_pending)
        self.engine = engine

    def submit(self, stream: ParaformerStream, audio: np.ndarray, is_final: bool) -> concurrent.futures.Future:
        """The tokens `audio` (float32, 16 kHz) completes on `stream`; any thread."""
        return self._enqueue(stream, _Audio(stream, np.asarray(audio, np.float32).reshape(-1), is_final))

    async def feed(self, stream: ParaformerStream, audio: np.ndarray, is_final: bool) -> Decoded:
        return await asyncio.wrap_future(self.submit(stream, audio, is_final))

    def _take(self, request: _Audio) -> bool:
        """Cut the pieces and make their features; none (under one stride, not final): the audio is
        kept in the stream for its next call, and the request is answered with no tokens."""
        request.pieces = request.stream.pieces(request.audio, request.is_final)
        return bool(request.pieces)

    def _call(self, requests: list[_Audio]) -> None:
        results = self.engine.step([(r.stream, r.pieces[0]) for r in requests])
        for request, result in zip(requests, results):
            request.pieces.pop(0)
            request.result.extend(result)

    def _done(self, request: _Audio) -> bool:
        return not request.pieces

    def _result(self, request: _Audio) -> Decoded:
        return request.result

    def _drop(self, request: _Audio) -> None:
        request.pieces = []
        request.stream.reset()
