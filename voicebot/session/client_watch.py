"""What every client message counts toward (the idle timeout, the flood guard), the input a
session does not hear counted as dropped, and the close a session asks its connection's owner for
(voicebot.frontends.run.run_session sends the error and closes)."""

from __future__ import annotations

import asyncio
from typing import Callable

from voicebot import protocol
from voicebot.config import Settings
from voicebot.metrics import Metrics
from voicebot.protocol import CloseCode, ErrorCode
from voicebot.guards.flood import FloodGuard
from voicebot.guards.idle import IdleWatch


class ClientWatch:
    def __init__(self, settings: Settings, metrics: Metrics, busy: Callable[[], bool]) -> None:
        limits = settings.limits
        self.flood = FloodGuard(limits.max_messages_per_s, limits.max_audio_realtime_factor, limits.window_s)
        self.idle = IdleWatch(settings.server.idle_timeout_s, busy=busy)
        self._metrics = metrics
        self.close_request: tuple[int, str, str] | None = None  # (close code, error code, reason)
        self.close_requested = asyncio.Event()

    def arrived(self, audio_bytes: int, sample_rate: int) -> bool:
        """One client message, holding `audio_bytes` of audio at `sample_rate`. False: refuse it (it
        floods, or the session is closing); its audio is counted as dropped."""
        self.idle.heard()
        # A frame over the frame limit counts as that limit: it is refused with frame_too_large, not
        # taken for a flood (a 256 KB frame at 16 kHz would empty the audio allowance at once);
        # frames that keep coming still flood it.
        audio_bytes = min(audio_bytes, protocol.audio_frame_limit(sample_rate))
        if self.close_request:
            self.dropped(audio_bytes, sample_rate, "closing")
            return False
        reason = self.flood.check(audio_bytes, sample_rate)
        if reason:
            self.dropped(audio_bytes, sample_rate, "flooding")
            self.request_close(CloseCode.FLOODING, ErrorCode.FLOODING, f"flooding: {reason}")
        return reason is None

    def dropped(self, audio_bytes: int, sample_rate: int, reason: str) -> None:
        """Input not heard, counted in voicebot_input_dropped_seconds_total by `reason`."""
        if audio_bytes:
            self._metrics.input_dropped.labels(reason).inc(audio_bytes / (2 * sample_rate))

    def request_close(self, close_code: int, error_code: str, reason: str) -> None:
        """Ask the connection's owner to send the error and close (the first request wins)."""
        if self.close_request is None:
            self.close_request = (close_code, error_code, reason)
            self.close_requested.set()

    async def close_when_idle(self) -> None:
        """From session.start on: ask for the close once the client has gone quiet (guards/idle.py)."""
        self.request_close(CloseCode.POLICY, ErrorCode.IDLE_TIMEOUT, await self.idle.expire())
