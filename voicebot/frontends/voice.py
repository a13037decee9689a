"""/v1/voice: its wire to the session's commands, the session's events to its wire.

The wire (docs/protocol.md): JSON text frames, each a client message (voicebot.protocol parses and
validates them: they are the session's commands as they are), and binary frames of s16le PCM
(an AudioChunk each). Out: each event as one JSON object, `type` first and its fields in the
order voicebot.session.events declares them; reply audio as binary frames. A channel's listeners
get the same wire, less the speaker's identity (`listener_wire`).

`parse` and `wire` are the translation, with no I/O (tests/frontends/test_voice.py);
`VoiceFrontEnd` meets the socket.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from voicebot import protocol
from voicebot.transport import Socket, Wire
from voicebot.messages import AudioFrame
from voicebot.protocol import ProtocolError
from voicebot.session import Session
from voicebot.session.commands import AudioChunk, Command
from voicebot.session.events import Outbound, ServerEvent, SessionReady

# What a channel's listeners never get of session.ready: the key to this session's conversation.
PRIVATE_FIELDS = ("session_id", "resume_token")


def parse(message: Wire) -> Command:
    """One /v1/voice message as the command it stands for; raise ProtocolError if it is none."""
    if isinstance(message, bytes):
        return AudioChunk(message)
    return protocol.parse_text(message)


def payload(event: ServerEvent) -> dict[str, Any]:
    """An event as its JSON object: `type`, then its fields (a `flat` field's keys in its place)."""
    body: dict[str, Any] = {"type": event.kind}
    for field in fields(event):
        value = getattr(event, field.name)
        if field.metadata.get("flat"):
            body.update(value)
        else:
            body[field.name] = value
    return body


def wire(message: Outbound) -> Wire:
    """One event or frame as the client gets it."""
    if isinstance(message, AudioFrame):
        return message.pcm
    return json.dumps(payload(message), ensure_ascii=False)


def listener_wire(message: Outbound) -> Wire:
    """One event or frame as a channel's listeners get it: all but the speaker's identity."""
    if isinstance(message, SessionReady):
        body = payload(message)
        return json.dumps({k: v for k, v in body.items() if k not in PRIVATE_FIELDS}, ensure_ascii=False)
    return wire(message)


class VoiceFrontEnd:
    """One /v1/voice speaking connection, for voicebot.frontends.run.run_session."""

    def __init__(self, ws: Socket) -> None:
        self._ws = ws

    async def start(self, session: Session) -> None:
        """Nothing: a /v1/voice client sends its own session.start."""

    async def on_message(self, session: Session, message: Wire) -> None:
        if not session.arrived(len(message) if isinstance(message, bytes) else 0):
            return
        try:
            command = parse(message)
        except ProtocolError as exc:
            await session.outbox.error(exc.code, exc.message)
            return
        await session.handle(command)

    async def deliver(self, message: Outbound) -> None:
        data = wire(message)
        if isinstance(data, bytes):
            await self._ws.send_bytes(data)
        else:
            await self._ws.send_text(data)

    def ended(self) -> None:
        """Nothing to report."""
