"""The flood guard: past its limits a client is abusing the server and its connection is closed.

Used by every route that takes audio: /v1/voice and /obs/audio (voicebot/session/machine.py) and
/funasr (voicebot/frontends/funasr_ws.py). Two token buckets, full at the start: messages, and seconds
of audio. Each refills at its rate (`max_messages_per_s`; `max_audio_factor` seconds of audio per
second) and holds `window_s` of it, so a client may catch up after a network stall of that long;
`audio_burst_s` more seconds of audio may come at any speed (a FunASR client sends a file whole).
"""

from __future__ import annotations

import time


class _Bucket:
    def __init__(self, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self._last = time.monotonic()

    def take(self, amount: float, now: float) -> bool:
        """Take `amount` if the bucket holds it at `now`; False (and nothing taken) if not."""
        self.level = min(self.capacity, self.level + (now - self._last) * self.rate)
        self._last = now
        if amount > self.level:
            return False
        self.level -= amount
        return True


class FloodGuard:
    """Counts messages and audio; past the limits the connection is closed."""

    def __init__(self, max_messages_per_s: float, max_audio_factor: float, window_s: float, audio_burst_s: float = 0.0) -> None:
        self.max_messages_per_s = max_messages_per_s
        self.max_audio_factor = max_audio_factor
        self._messages = _Bucket(max_messages_per_s, max_messages_per_s * window_s)
        self._audio_s = _Bucket(max_audio_factor, max_audio_factor * window_s + audio_burst_s)

    def check(self, audio_bytes: int, sample_rate: int, arrived: float | None = None) -> str | None:
        """Count one message carrying `audio_bytes` of s16le audio, which came off the socket at
        `arrived` (monotonic; default now: a caller that checks messages after they waited passes
        when each came, in order); return why the client floods, or None."""
        now = time.monotonic() if arrived is None else arrived
        if not self._messages.take(1, now):
            return f"more than {self.max_messages_per_s:.0f} messages per second"
        if audio_bytes and not self._audio_s.take(audio_bytes / (2 * sample_rate), now):
            return f"audio faster than {self.max_audio_factor:g}x real time"
        return None
