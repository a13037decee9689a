"""/v1/realtime: an OpenAI Realtime connection presented as a /v1/voice client to `run_session`.

Like voicebot.obs_plugin.ObsSocket: `receive()` gives the session /v1/voice messages (a
`session.start` at 24 kHz first, then what each Realtime client event stands for), and
`send_text` / `send_bytes` turn the session's events and frames into Realtime server events.
The translation is voicebot.realtime_events (no I/O); here it meets the socket and the session,
whose hooks do what /v1/voice has no message for (a typed user message answered, a reply
truncated where the client's playback stopped, the client's instructions, the VAD threshold).
Every message is JSON text: a binary message gets an `error` and the connection goes on.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque

from starlette.websockets import WebSocket, WebSocketState

from voicebot.metrics import Metrics
from voicebot.realtime_events import Action, Answer, Clear, Forward, Instruct, RealtimeTranslator, Send, SetThreshold, Truncate
from voicebot.session import Session


class RealtimeSocket:
    """One Realtime connection (see module doc); `attach` gives it the session it feeds."""

    def __init__(self, ws: WebSocket, translator: RealtimeTranslator, metrics: Metrics) -> None:
        self._ws = ws
        self.translator = translator
        self._metrics = metrics
        self._session: Session | None = None
        self._started = False
        # What one client event stands for, handed to the session before the next event is read:
        # at most the chunks of one append (a 64 KiB text frame holds about 1 s of audio: 2 chunks).
        self._for_session: deque[dict] = deque()
        self._send_lock = asyncio.Lock()  # the session's sender and this receive loop both send

    def attach(self, session: Session) -> None:
        self._session = session

    async def receive(self) -> dict:
        if not self._started:
            self._started = True
            return _asgi(self.translator.start())
        while not self._for_session:
            message = await self._ws.receive()
            if message["type"] == "websocket.disconnect":
                return message
            if message.get("text") is None:
                if not self._session.heard_unforwarded():
                    continue
                await self._answer(self.translator.error("binary messages are not part of the protocol: send "
                                                       "input_audio_buffer.append with base64 audio", "invalid_event"))
                continue
            actions = self.translator.client_event(message["text"])
            # An event the session does not see still counts as the client's (idle timeout, flood guard).
            if not any(isinstance(a, Forward) for a in actions) and not self._session.heard_unforwarded():
                continue  # flooding: the session is closing; the receive loop stops
            for action in actions:
                await self._perform(action)
        return self._for_session.popleft()

    async def _perform(self, action: Action) -> None:
        session = self._session
        if isinstance(action, Forward):
            self._for_session.append(_asgi(action))
        elif isinstance(action, Send):
            await self._answer(action.event)
        elif isinstance(action, Answer):
            await session.answer(action.text)
        elif isinstance(action, Instruct):
            session.conversation.instructions = action.text
        elif isinstance(action, SetThreshold):
            endpointer = session.listening.front_end.endpointer
            endpointer.config = endpointer.config.model_copy(update={"threshold": action.threshold})
        elif isinstance(action, Truncate):
            await self._truncate(action)
        elif isinstance(action, Clear):
            await session.clear_input()

    async def _truncate(self, action: Truncate) -> None:
        reply = self._session.last_reply
        if reply is None or reply.id != action.reply_id:
            await self._answer(self.translator.error("only the latest response can be truncated", "item_truncate_invalid_item_id",
                                                   "item_id"))
            return
        # A no-op if it has ended; otherwise it stops here, its response.done reporting what was played.
        await self._session.interrupt("client", played_ms=action.audio_end_ms)
        heard = reply.truncate(action.audio_end_ms)
        await self._answer(self.translator.truncated(action, heard))

    async def _answer(self, event: dict) -> None:
        """An event of this adapter's own (the session's errors are counted where they are made)."""
        if event["type"] == "error":
            self._metrics.errors.labels(event["error"]["code"]).inc()
        await self._send(event)

    async def _send(self, event: dict) -> None:
        async with self._send_lock:
            await self._ws.send_text(json.dumps(event, ensure_ascii=False))

    # ---- what run_session uses of a socket -------------------------------------------------

    @property
    def client_state(self) -> WebSocketState:
        return self._ws.client_state

    @property
    def application_state(self) -> WebSocketState:
        return self._ws.application_state

    async def send_text(self, text: str) -> None:
        for event in self.translator.server_text(text):
            await self._send(event)

    async def send_bytes(self, data: bytes) -> None:
        for event in self.translator.server_audio(data):
            await self._send(event)

    async def close(self, code: int, reason: str) -> None:
        await self._ws.close(code, reason)


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
        for event in self._translator.server_text(json.dumps(data)):
            await self._ws.send_json(event)


def _asgi(forward: Forward) -> dict:
    key = "bytes" if isinstance(forward.wire, bytes) else "text"
    return {"type": "websocket.receive", key: forward.wire}
