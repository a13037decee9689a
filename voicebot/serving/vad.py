"""Silero VAD windows of every session in one onnxruntime call.

The /funasr route's segmenter and the transcription endpoint submit the windows of their latest
chunk (`submit`, `probabilities`) and await their speech probabilities; a thread of its own runs
them (voicebot/serving/batcher.py: the steps, bounds, counts and failures every batcher shares).
Live /v1/voice, /obs/audio and /v1/realtime sessions run Silero on the input clock's thread instead,
in the same steps, with their front ends (voicebot/serving/input_clock.py).

A stream's windows are sequential (its recurrent state carries from one window to the next), so
one step takes the next window of each stream waiting, in one `silero_step` call; a stream whose
chunk held k windows takes part in k steps (one stream alone gets the per-stream call). Each stream
keeps its own state, so its probabilities do not depend on who else is in the batch
(tests/serving/test_vad.py).

Bounds: at most `max_pending` requests (1024) are waiting or running, one per stream, each holding
one chunk's windows, at most protocol.MAX_CHUNK_SECONDS of 16 kHz float32; `submit` raises
`VadOverloaded` past it. A step takes at most `max_batch` rows (64), oldest first. A step that
raises fails its rows with `StepFailed`; a break of the loop fails what the thread held with
`VadFault`; both are counted (`thread_faults`, voicebot_vad_thread_faults_total).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field

import numpy as np

from voicebot.serving.batcher import BatcherFault, BatcherOverloaded, StepBatcher
from voicebot.serving.silero import SileroVad, silero_session, silero_step

# What a client refused with VadOverloaded is told (retry_after_s): the batcher drains in steps of
# milliseconds, so the client may send again soon.
VAD_RETRY_AFTER_S = 1


class VadOverloaded(BatcherOverloaded):
    """More VAD requests are waiting than the batcher's bound."""


class VadFault(BatcherFault):
    """The batcher's loop was broken while it held this request; the loop goes on."""


@dataclass(eq=False)
class _Windows:
    vad: SileroVad
    windows: np.ndarray  # (k, WINDOW)
    probabilities: np.ndarray = field(init=False)
    judged: int = 0  # windows done so far

    def __post_init__(self) -> None:
        self.probabilities = np.zeros(len(self.windows), np.float32)


class VadBatcher(StepBatcher[_Windows]):
    overloaded = VadOverloaded
    fault = VadFault

    def __init__(self, max_batch: int = 64, max_pending: int = 1024) -> None:
        super().__init__("vad", max_batch, max_pending)

    def start(self) -> None:
        silero_session()  # load the graph before the first session needs it
        super().start()

    def submit(self, vad: SileroVad, windows: np.ndarray) -> concurrent.futures.Future:
        """The speech probability of each of one stream's windows (k, WINDOW), in order; any thread."""
        request = _Windows(vad, windows)
        if not len(windows):
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(request.probabilities)
            return future
        return self._enqueue(vad, request)

    async def probabilities(self, vad: SileroVad, windows: np.ndarray) -> np.ndarray:
        return await asyncio.wrap_future(self.submit(vad, windows))

    def _call(self, requests: list[_Windows]) -> None:
        probabilities = silero_step([r.vad for r in requests], np.stack([r.windows[r.judged] for r in requests]))
        for request, probability in zip(requests, probabilities):
            request.probabilities[request.judged] = probability
            request.judged += 1

    def _done(self, request: _Windows) -> bool:
        return request.judged == len(request.windows)

    def _result(self, request: _Windows) -> np.ndarray:
        return request.probabilities
