"""What the device spends per step, measured by the scheduler (voicebot/serving/scheduler.py): the
LM decode step per batch size, measured at start-up (`Scheduler.calibrate`, which also captures
every CUDA graph bucket then) and kept current by every step; the render cost per second of audio,
from a probe render at start-up and every render since. Admission (`Scheduler.capacity`) reads them."""

from __future__ import annotations

import math


class StepCosts:
    """Exponential moving averages of what the device spends: seconds per LM decode step by batch
    size, and seconds of rendering per second of audio. Thread-safe reads (floats)."""

    ALPHA = 0.1

    def __init__(self) -> None:
        self.decode: dict[int, float] = {}
        self.render_per_audio_s: float | None = None
        self.render_call: float | None = None  # seconds per render call

    def add_decode(self, batch: int, seconds: float) -> None:
        old = self.decode.get(batch)
        self.decode[batch] = seconds if old is None else old + self.ALPHA * (seconds - old)

    def add_render(self, seconds: float, audio_s: float) -> None:
        old = self.render_call
        self.render_call = seconds if old is None else old + self.ALPHA * (seconds - old)
        if audio_s <= 0:
            return
        rate, old = seconds / audio_s, self.render_per_audio_s
        self.render_per_audio_s = rate if old is None else old + self.ALPHA * (rate - old)

    def decode_step(self, batch: int) -> float | None:
        """The cost of a step at `batch` rows, interpolated linearly between measured sizes
        (extrapolated from the two largest above them)."""
        sizes = sorted(self.decode)
        if not sizes:
            return None
        if batch in self.decode:
            return self.decode[batch]
        below = [s for s in sizes if s < batch]
        above = [s for s in sizes if s > batch]
        if below and above:
            a, b = below[-1], above[0]
        elif len(below) >= 2:
            a, b = below[-2], below[-1]
        else:
            return self.decode[sizes[0]]
        ca, cb = self.decode[a], self.decode[b]
        return max(ca, ca + (cb - ca) * (batch - a) / (b - a))

    def load(self, speaking: int, tokens_per_s: float, max_batch: int) -> float | None:
        """Busy fraction of the device with `speaking` sessions in real time: 25 LM steps a second
        for every batch of up to max_batch of them, plus each session's render cost."""
        batches, rows = math.ceil(speaking / max_batch), min(speaking, max_batch)
        step = self.decode_step(rows)
        if step is None:
            return None
        return tokens_per_s * batches * step + speaking * (self.render_per_audio_s or 0.0)
