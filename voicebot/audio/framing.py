"""Re-chunk any stream of samples into exact frames (200 ms of 24 kHz audio = 4800 samples).

The first frame leaves as soon as a full frame of samples exists; `flush()` returns the rest as
one shorter last frame. Memory bound: less than one frame of samples is ever held.
"""

from __future__ import annotations

import numpy as np

from voicebot.audio.rates import SPEAK_RATE


class Framer:
    def __init__(self, sample_rate: int = SPEAK_RATE, frame_ms: int = 200) -> None:
        self.frame_samples = sample_rate * frame_ms // 1000
        self._pending = np.zeros(0, np.float32)

    def push(self, samples: np.ndarray) -> list[np.ndarray]:
        """Return every complete frame now available, in order."""
        data = np.concatenate([self._pending, np.asarray(samples, np.float32)]) if len(self._pending) else np.asarray(samples, np.float32)
        n_full = len(data) // self.frame_samples
        cut = n_full * self.frame_samples
        frames = [data[i : i + self.frame_samples] for i in range(0, cut, self.frame_samples)]
        self._pending = data[cut:].copy()
        return frames

    def flush(self) -> np.ndarray | None:
        """The final partial frame, if any samples are left."""
        rest, self._pending = self._pending, np.zeros(0, np.float32)
        return rest if len(rest) else None

    def clear(self) -> int:
        """Drop pending samples (barge-in); returns how many were dropped."""
        dropped = len(self._pending)
        self._pending = np.zeros(0, np.float32)
        return dropped
