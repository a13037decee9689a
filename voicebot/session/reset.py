"""The periodic reset of a session's engine state: drop and rebuild the recognizer's and the
synthesizer's per-session state, timed, counted and reported as a `state.reset` event.

When is the session's call (Session._reset_timer): only at a turn boundary, under the engine lock.
"""

from __future__ import annotations

import time

from voicebot.asr.base import RecognizerStream
from voicebot.metrics import Metrics
from voicebot.session.events import StateReset
from voicebot.session.outbox import Outbox
from voicebot.tts.base import SynthesisContext


class EngineReset:
    def __init__(self, interval_s: float, asr: RecognizerStream, tts: SynthesisContext, metrics: Metrics, outbox: Outbox) -> None:
        self.interval_s = interval_s
        self._engines = (asr, tts)
        self._metrics = metrics
        self._outbox = outbox
        self._last = time.monotonic()
        self.count = 0

    @property
    def check_every_s(self) -> float:
        return max(0.05, min(1.0, self.interval_s / 4))

    @property
    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval_s

    async def run(self, reason: str) -> None:
        """Reset every engine; report what was renewed. An engine that could not rebuild its state
        (it keeps the old: a CosyVoice 2 voice derivation failed) was not reset, and is named apart
        (`skipped`, voicebot_resets_skipped_total); a reset that renewed nothing sends nothing."""
        start = time.perf_counter()
        reports = [await engine.reset() for engine in self._engines]
        duration = time.perf_counter() - start
        self._last = time.monotonic()  # a skipped engine tries again at the next interval, not at once
        renewed = [r for r in reports if not r.skipped]
        skipped = [r.engine for r in reports if r.skipped]
        for engine in skipped:
            self._metrics.resets_skipped.labels(engine).inc()
        if not renewed:
            return
        self.count += 1
        self._metrics.resets.inc()
        self._metrics.reset_duration.observe(duration)
        await self._outbox.emit(StateReset(
            reason,
            duration_ms=round(duration * 1000, 2),
            engines=[{"engine": r.engine, "generation": r.generation, "bytes_freed": r.bytes_freed} for r in renewed],
            skipped=skipped,
        ))
