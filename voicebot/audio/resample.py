"""The one place where audio changes sample rate (soxr) or sample format.

Every boundary declares its rate: client input (any rate in 8-48 kHz) becomes 16 kHz float32 here,
engine output becomes 24 kHz here, and nothing else in the server resamples.
"""

from __future__ import annotations

import numpy as np
import soxr


def pcm16_to_float(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


def float_to_pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class StreamResampler:
    """Streaming resampler for one direction of one session; passes audio through when rates match.

    soxr keeps a small filter state between chunks, so the concatenated output equals resampling
    the whole signal at once; `flush()` returns the tail held in the filter.
    """

    def __init__(self, in_rate: int, out_rate: int, quality: str = "HQ") -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._soxr = None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=quality)

    def process(self, audio: np.ndarray) -> np.ndarray:
        audio = np.ascontiguousarray(audio, dtype=np.float32)
        if self._soxr is None:
            return audio
        return self._soxr.resample_chunk(audio, last=False)

    def flush(self) -> np.ndarray:
        if self._soxr is None:
            return np.zeros(0, np.float32)
        return self._soxr.resample_chunk(np.zeros(0, np.float32), last=True)
