"""The flood guard: past its limits a client is abusing the server and its session is closed."""

from __future__ import annotations

import time


class FloodGuard:
    """Counts messages and audio bytes per window; past the limits the session is closed."""

    def __init__(self, max_messages_per_s: float, max_audio_factor: float, window_s: float) -> None:
        self.max_messages = max_messages_per_s * window_s
        self.max_audio_factor = max_audio_factor
        self.window_s = window_s
        self._start = time.monotonic()
        self._messages = 0
        self._audio_bytes = 0

    def check(self, audio_bytes: int, sample_rate: int) -> str | None:
        """Count one message; return why the session floods, or None."""
        now = time.monotonic()
        if now - self._start >= self.window_s:
            self._start, self._messages, self._audio_bytes = now, 0, 0
        self._messages += 1
        self._audio_bytes += audio_bytes
        if self._messages > self.max_messages:
            return f"more than {self.max_messages / self.window_s:.0f} messages per second"
        allowed = self.max_audio_factor * sample_rate * 2 * self.window_s
        if self._audio_bytes > allowed:
            return f"audio faster than {self.max_audio_factor:g}x real time"
        return None
