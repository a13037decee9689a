"""FunASR's fsmn-vad as the endpointer of /funasr (`asr.paraformer.vad_model`).

The FunASR runtime segments with fsmn-vad; a client tuned against it gets the same utterance
boundaries here. One loaded model and one worker thread serve every connection; each connection
has its own `FsmnSegmenter` holding its funasr cache and the little audio it needs to look back.

fsmn-vad reports, in ms since the stream began, [beg, -1] when speech starts, [-1, end] when it
ends and [beg, end] for a whole segment inside one call. It reports a start ~200-400 ms after
the speech began, so audio is kept for that look-back until speech starts (never more than
`_LOOKBACK_S`); inside speech each piece is handed on at once and nothing accumulates.

funasr's VAD cache keeps a record of every segment of the stream, so after each segment ends the
cache is started afresh (its positions then count from that point): nothing grows with the
number of utterances.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from voicebot.asr.base import SAMPLE_RATE
from voicebot.asr.funasr_model import load_automodel, state_bytes
from voicebot.audio.endpoint import EventKind, VadEvent
from voicebot.serving.worker import Worker

_LOOKBACK_S = 2.0


class FsmnVad:
    def __init__(self, path: Path, device: str = "cpu", threads: int = 1, end_silence_ms: int = 500) -> None:
        self.path = Path(path)
        self.device = device
        self.threads = threads
        # A fixed end-of-speech silence, as for /v1/voice; funasr's default is a schedule that
        # waits up to 2 s at the start of an utterance.
        self.end_silence_ms = end_silence_ms
        self.worker = Worker("fsmn-vad", threads=1)
        self._auto: Any = None

    def load(self) -> None:
        self._auto = load_automodel(self.path, self.device, self.threads)

    def step_blocking(self, cache: dict, audio: np.ndarray, is_final: bool) -> list[list[int]]:
        """Segments [beg_ms, end_ms] (-1: not yet known) found in this piece; runs on the worker."""
        result = self._auto.generate(
            input=audio, cache=cache, is_final=is_final, chunk_size=max(10, len(audio) * 1000 // SAMPLE_RATE),
            max_end_silence_time=self.end_silence_ms, key="vad",
        )
        return result[0]["value"] if result else []

    def segmenter(self) -> FsmnSegmenter:
        return FsmnSegmenter(self)

    def close(self) -> None:
        self.worker.shutdown()
        self._auto = None


class FsmnSegmenter:
    """One connection's endpointer: the `Segmenter` interface of voicebot.frontends.funasr_protocol."""

    def __init__(self, vad: FsmnVad) -> None:
        self.vad = vad
        self._cache: dict = {}
        self._held = np.zeros(0, np.float32)  # recent audio not yet handed on
        self._held_start = 0  # stream position (samples) of _held[0]
        self._origin = 0  # stream position where the VAD's cache (and its clock) started
        self._fed = 0  # samples given to the VAD so far
        self.in_speech = False

    def state_bytes(self) -> int:
        return state_bytes(self._cache) + self._held.nbytes

    async def process(self, audio: np.ndarray) -> list[VadEvent]:
        audio = np.asarray(audio, np.float32)
        if not len(audio):
            return []
        segments = await self.vad.worker.run(self.vad.step_blocking, self._cache, audio, False)
        self._held = np.concatenate([self._held, audio])
        self._fed += len(audio)
        events: list[VadEvent] = []
        for beg, end in segments:
            if beg >= 0 and not self.in_speech:
                start = max(0, self._origin + beg * SAMPLE_RATE // 1000 - self._held_start)
                events.append(VadEvent(EventKind.START, self._take(start, len(self._held))))
                self.in_speech = True
            if end >= 0 and self.in_speech:
                end_sample = self._origin + end * SAMPLE_RATE // 1000
                events.append(VadEvent(EventKind.AUDIO, self._take(0, max(0, end_sample - self._held_start))))
                events.append(VadEvent(EventKind.END, np.zeros(0, np.float32), speech_end_sample=end_sample))
                self.in_speech = False
                self._cache, self._origin = {}, self._fed
                break  # the fresh cache has seen nothing of the rest of this piece
        if self.in_speech:
            events.append(VadEvent(EventKind.AUDIO, self._take(0, len(self._held))))
        self._forget_old()
        return [e for e in events if e.kind is EventKind.END or len(e.audio)]

    async def force_end(self) -> list[VadEvent]:
        events = [VadEvent(EventKind.END, np.zeros(0, np.float32))] if self.in_speech else []
        # A new stream for whatever comes next: the client ended this one.
        self._cache, self._origin, self.in_speech = {}, self._fed, False
        self._held_start += len(self._held)
        self._held = np.zeros(0, np.float32)
        return events

    def _take(self, start: int, stop: int) -> np.ndarray:
        """Hand on _held[start:stop] and drop everything before `stop`."""
        taken = self._held[start:stop]
        self._held = self._held[stop:]
        self._held_start += stop
        return taken

    def _forget_old(self) -> None:
        excess = len(self._held) - int(_LOOKBACK_S * SAMPLE_RATE)
        if excess > 0:
            self._take(0, excess)
