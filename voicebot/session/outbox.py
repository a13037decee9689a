"""The outbox: every message a session sends, in order, on its way to the socket.

Bound: OUTBOX_MAX messages, at most 64 frames of 9600 bytes (600 KB); the pacer keeps reply audio
only `pacing.lead_ms` ahead of playback, so in practice it holds a few frames and events. The
stages put typed messages (voicebot.messages.Event / AudioFrame); the sender puts them on the wire.
"""

from __future__ import annotations

import asyncio

from voicebot import protocol
from voicebot.messages import AudioFrame, Event, Outbound
from voicebot.metrics import Metrics

OUTBOX_MAX = 64


class Outbox:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._queue: asyncio.Queue[Outbound | None] = asyncio.Queue(OUTBOX_MAX)

    async def emit(self, payload: dict) -> None:
        await self._queue.put(Event(payload))

    async def error(self, code: str, message: str, **extra) -> None:
        self._metrics.errors.labels(code).inc()
        await self.emit(protocol.error(code, message, **extra))

    async def frame(self, pcm: bytes) -> None:
        await self._queue.put(AudioFrame(pcm))

    async def put(self, message: Outbound | None) -> None:
        """Queue a message; None ends the sender once everything before it is sent."""
        await self._queue.put(message)

    async def get(self) -> Outbound | None:
        return await self._queue.get()
