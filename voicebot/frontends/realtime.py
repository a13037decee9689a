"""/v1/realtime: an OpenAI Realtime connection, translated for `run_session`.

The translation is voicebot.frontends.realtime_events (no I/O): each client event becomes the session's typed
commands (a `session.start` at 24 kHz opens it) and events of the translator's own for the client;
each of the session's typed events and frames becomes Realtime server events. Here it meets the
socket. Every message is JSON text: a binary message gets an `error` and the connection goes on.
"""

from __future__ import annotations

import asyncio
import json

from starlette.websockets import WebSocket

from voicebot.metrics import Metrics
from voicebot.frontends.realtime_events import RealtimeTranslator, Send
from voicebot.session import Session
from voicebot.session.commands import AudioChunk
from voicebot.session.events import Error, Outbound, TruncateRefused
from voicebot.transport import Wire


class RealtimeFrontEnd:
    """One Realtime connection (see module doc)."""

    def __init__(self, ws: WebSocket, translator: RealtimeTranslator, metrics: Metrics) -> None:
        self._ws = ws
        self.translator = translator
        self._metrics = metrics
        self._send_lock = asyncio.Lock()  # the session's sender and the receive loop both send

    async def start(self, session: Session) -> None:
        await session.handle(self.translator.start())

    async def on_message(self, session: Session, message: Wire) -> None:
        if isinstance(message, bytes):
            if session.arrived():
                await self._answer(self.translator.error("binary messages are not part of the protocol: send "
                                                         "input_audio_buffer.append with base64 audio", "invalid_event"))
            return
        actions = self.translator.client_event(message)
        # Every client event counts (idle timeout, flood guard), the ones answered here too.
        if not session.arrived(sum(len(a.pcm) for a in actions if isinstance(a, AudioChunk))):
            return  # flooding: the session is closing; the receive loop stops
        for action in actions:
            if isinstance(action, Send):
                await self._answer(action.event)
            else:
                await session.handle(action)

    async def deliver(self, message: Outbound) -> None:
        for event in self.translator.server_event(message):
            if isinstance(message, TruncateRefused):  # a refusal of this protocol's, not a session error
                self._count(event)
            await self._send(event)

    def ended(self) -> None:
        """Nothing to report."""

    async def _answer(self, event: dict) -> None:
        """An event of this front end's own (the session's errors are counted where they are made)."""
        self._count(event)
        await self._send(event)

    def _count(self, event: dict) -> None:
        if event["type"] == "error":
            self._metrics.errors.labels(event["error"]["code"]).inc()

    async def _send(self, event: dict) -> None:
        async with self._send_lock:
            await self._ws.send_text(json.dumps(event, ensure_ascii=False))


class RefusingInOpenAIShape:
    """The WebSocket as admission (voicebot.app admit, voicebot.auth) uses it, with its refusals
    (busy, unauthorized, forbidden_origin, ...: voicebot error events) sent in OpenAI's shape,
    so that a Realtime client reads them as it reads any error."""

    def __init__(self, ws: WebSocket, translator: RealtimeTranslator) -> None:
        self._ws = ws
        self._translator = translator

    def __getattr__(self, name: str):
        return getattr(self._ws, name)

    async def send_json(self, data: dict) -> None:
        """`data`: a refusal as voicebot.protocol.error builds it."""
        details = {k: v for k, v in data.items() if k not in ("type", "code", "message")}
        for event in self._translator.server_event(Error(data["code"], data["message"], details)):
            await self._ws.send_json(event)
