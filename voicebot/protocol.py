"""The /v1/voice wire protocol: every message as a typed model, parsed and validated here only.

Text frames are JSON objects with a `type`; binary frames are raw s16le mono PCM at the rate the
client declared in `session.start`. Nothing here touches a socket: `parse_text` and
`check_audio` turn raw input into a message or a `ProtocolError` with a stable `code`, and the
session decides what to do with it. docs/protocol.md documents every message, code and close code.
"""

from __future__ import annotations

import json
import re
from enum import IntEnum
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from voicebot import PROTOCOL_VERSION
from voicebot.audio.rates import SPEAK_RATE as OUTPUT_SAMPLE_RATE

MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000
MAX_CHUNK_SECONDS = 1.0
FRAME_MS = 200
# A channel name, as in `session.start {channel}` and `/v1/voice?role=listener&channel=NAME`.
CHANNEL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class ErrorCode:
    """Stable `code` values of `error` events (clients may switch on them)."""

    INVALID_JSON = "invalid_json"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_MESSAGE = "invalid_message"  # a field missing, ill-typed or out of range
    BAD_SAMPLE_RATE = "bad_sample_rate"
    ODD_PCM_BYTES = "odd_pcm_bytes"
    FRAME_TOO_LARGE = "frame_too_large"
    NOT_STARTED = "not_started"  # audio or a command before session.start
    ALREADY_STARTED = "already_started"
    UNKNOWN_VOICE = "unknown_voice"
    UNKNOWN_RESPONDER = "unknown_responder"
    BUSY = "busy"  # max_sessions reached; retry_after_s says when to try again
    ENGINE_ERROR = "engine_error"  # a model failed on this input; the session goes on
    REPLY_FAILED = "reply_failed"  # the responder failed; a fallback line may be spoken
    FLOODING = "flooding"  # sent just before the close with CloseCode.FLOODING
    SHUTTING_DOWN = "shutting_down"
    UNAUTHORIZED = "unauthorized"  # missing or wrong token; sent just before CloseCode.UNAUTHORIZED
    READ_ONLY = "read_only"  # a listener sent something other than ping


class CloseCode(IntEnum):
    NORMAL = 1000
    GOING_AWAY = 1001  # server shutting down
    TRY_AGAIN_LATER = 1013  # busy: max_sessions reached
    POLICY = 1008  # a connection the server will not serve (e.g. a listener without a channel)
    FLOODING = 4008  # messages or bytes per second far above real time
    TOO_SLOW = 4009  # a listener fell behind its channel and was dropped
    UNAUTHORIZED = 4401


class ProtocolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ---- client -> server -------------------------------------------------------------------------


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EndpointingUpdate(_Message):
    # What ends a turn: the end-of-turn model, or the silence rule; an endpoint_silence_ms alone
    # asks for the silence rule with that wait.
    turn: Literal["smart", "silence"] | None = None
    endpoint_silence_ms: int | None = Field(None, ge=100, le=5000)
    barge_in_min_ms: int | None = Field(None, ge=0, le=5000)


class SessionStart(_Message):
    type: Literal["session.start"]
    sample_rate: int = 16000
    voice: str | None = None
    responder: str | None = None
    language: str | None = None
    channel: str | None = Field(None, pattern=f"^{CHANNEL_NAME.pattern}$")
    resume: str | None = None  # a previous session_id, to continue its conversation
    endpointing: EndpointingUpdate | None = None
    # Cancel the bot's own voice from the input (voicebot/audio/echo.py); None: the endpoint's
    # default (on for /obs/audio, off for /v1/voice, where browsers cancel their own).
    echo_cancellation: bool | None = None


class SessionUpdate(_Message):
    type: Literal["session.update"]
    voice: str | None = None
    responder: str | None = None
    language: str | None = None
    endpointing: EndpointingUpdate | None = None


class InputEnd(_Message):
    type: Literal["input.end"]


class Say(_Message):
    type: Literal["say"]
    text: str = Field(min_length=1, max_length=2000)
    interrupt: bool = False


class Interrupt(_Message):
    type: Literal["interrupt"]


class Ping(_Message):
    type: Literal["ping"]
    id: str | int | None = None


ClientMessage = Annotated[
    Union[SessionStart, SessionUpdate, InputEnd, Say, Interrupt, Ping], Field(discriminator="type")
]
_client_message = TypeAdapter(ClientMessage)
CLIENT_TYPES = ("session.start", "session.update", "input.end", "say", "interrupt", "ping")


def parse_text(raw: str) -> SessionStart | SessionUpdate | InputEnd | Say | Interrupt | Ping:
    """Parse one text frame; raise ProtocolError with a code a client can switch on."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(ErrorCode.INVALID_JSON, f"text frame is not valid JSON: {exc.msg} at position {exc.pos}")
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "a text frame must be a JSON object with a 'type'")
    kind = data.get("type")
    if kind not in CLIENT_TYPES:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}; expected one of {', '.join(CLIENT_TYPES)}"
        )
    try:
        message = _client_message.validate_python(data)
    except ValidationError as exc:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"{kind}: {_describe(exc)}") from None
    if isinstance(message, SessionStart) and not MIN_SAMPLE_RATE <= message.sample_rate <= MAX_SAMPLE_RATE:
        raise ProtocolError(
            ErrorCode.BAD_SAMPLE_RATE,
            f"sample_rate {message.sample_rate} is outside {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz",
        )
    return message


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"][1:]) or "message"  # loc[0] is the union tag
        parts.append(f"field '{field}': {err['msg']}")
    return "; ".join(parts)


def check_audio(nbytes: int, sample_rate: int) -> None:
    """Validate one binary frame of s16le mono PCM."""
    if nbytes % 2:
        raise ProtocolError(ErrorCode.ODD_PCM_BYTES, f"binary frame has {nbytes} bytes; s16le PCM needs an even count")
    limit = int(sample_rate * MAX_CHUNK_SECONDS) * 2
    if nbytes > limit:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE,
            f"binary frame of {nbytes} bytes is over 1 s of audio at {sample_rate} Hz ({limit} bytes); send smaller chunks",
        )


# ---- server -> client -------------------------------------------------------------------------


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event; `kind` is one of the types documented in docs/protocol.md."""
    return {"type": kind, **fields}


def session_ready(session_id: str, input_sample_rate: int, voice: str, responder: str, resumed: bool) -> dict:
    return event(
        "session.ready",
        session_id=session_id,
        protocol_version=PROTOCOL_VERSION,
        input_sample_rate=input_sample_rate,
        output_sample_rate=OUTPUT_SAMPLE_RATE,
        frame_ms=FRAME_MS,
        voice=voice,
        responder=responder,
        resumed=resumed,
    )


def error(code: str, message: str, **extra: Any) -> dict:
    return event("error", code=code, message=message, **extra)
