"""The outbox: every message a session sends, in order, on its way to its front end.

Bound: OUTBOX_MAX messages, at most 64 frames of 9600 bytes (600 KB); the pacer keeps reply audio
only `pacing.lead_ms` ahead of playback, so in practice it holds a few frames and events. The
stages put typed messages (voicebot.session.events, voicebot.messages.AudioFrame); the session's
sender hands them to its front end, which writes its own wire.
"""

from __future__ import annotations

import asyncio

from voicebot.messages import AudioFrame
from voicebot.metrics import Metrics
from voicebot.session import events
from voicebot.session.events import Outbound, ServerEvent

OUTBOX_MAX = 64


class Outbox:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._queue: asyncio.Queue[Outbound | None] = asyncio.Queue(OUTBOX_MAX)

    async def emit(self, event: ServerEvent) -> None:
        """Queue an event."""
        await self._queue.put(event)

    async def error(self, code: str, message: str, **details) -> None:
        """Queue an `error` event, counted in voicebot_errors_total by its code."""
        self._metrics.errors.labels(code).inc()
        await self._queue.put(events.Error(code, message, details))

    async def frame(self, pcm: bytes) -> None:
        await self._queue.put(AudioFrame(pcm))

    async def put(self, message: Outbound | None) -> None:
        """Queue a message; None ends the sender once everything before it is sent."""
        await self._queue.put(message)

    async def get(self) -> Outbound | None:
        return await self._queue.get()

    def empty(self) -> bool:
        return self._queue.empty()
