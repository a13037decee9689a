"""The /v1/voice wire protocol: every message as a typed model, parsed and validated here only.

Text frames are JSON objects with a `type`; binary frames are raw s16le mono PCM at the rate the
client declared in `session.start`. Nothing here touches a socket: `parse_text` and
`check_audio` turn raw input into a message or a `ProtocolError` with a stable `code`, and the
session decides what to do with it. docs/protocol.md documents every message, code and close code.

`load_json` is the input policy of every route's text frames (/v1/voice, the OBS plugin's control
messages, FunASR's messages): a bounded size, nesting depth and number length, checked before or
while parsing (Python's json recurses per level and converts any number of digits), and strings
that are Unicode text (JSON's \\u escapes can spell a lone surrogate, which no reply echoing it
could encode). Types are strict: `"interrupt": "yes"` is an error, not true.
"""

from __future__ import annotations

import json
import math
import re
from enum import IntEnum
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000
MAX_CHUNK_SECONDS = 1.0
FRAME_MS = 200
# A channel name, as in `session.start {channel}` and `/v1/voice?role=listener&channel=NAME`.
CHANNEL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# Text frames on every route. The largest valid one is a `say` of 2000 characters, each written as
# a 12-character escaped surrogate pair (about 24 KB); FunASR's first message with a hotword list
# is of the same order. Deepest valid nesting: 2 (session.start's endpointing, FunASR's chunk_size).
MAX_TEXT_CHARS = 64 * 1024
MAX_JSON_DEPTH = 8
MAX_NUMBER_CHARS = 32  # a JSON number literal, sign, fraction and exponent included
# Any WebSocket message, on any route: past this the server closes with 1009 (CloseCode.TOO_BIG).
# The largest valid message is an /obs/audio chunk of 1 s at 192 kHz, 8 channels, with two
# 1024-byte source names: 28 + 2048 + 3,072,000 = 3,074,076 bytes. uvicorn's `ws_max_size`.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# An id the client gets back in `pong`: a JavaScript number holds integers up to 2**53 exactly.
MAX_PING_ID = 2**53 - 1


class ErrorCode:
    """Stable `code` values of `error` events (clients may switch on them)."""

    INVALID_JSON = "invalid_json"
    UNSUPPORTED_JSON = "unsupported_json"  # JSON past the limits: too deep, a huge number, a lone surrogate
    UNKNOWN_TYPE = "unknown_type"
    INVALID_MESSAGE = "invalid_message"  # a field missing, ill-typed or out of range
    BAD_SAMPLE_RATE = "bad_sample_rate"
    ODD_PCM_BYTES = "odd_pcm_bytes"
    FRAME_TOO_LARGE = "frame_too_large"  # over 1 s of audio, or a text frame over MAX_TEXT_CHARS
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
    FORBIDDEN_ORIGIN = "forbidden_origin"  # a web page not in server.allowed_origins; then CloseCode.POLICY
    START_TIMEOUT = "start_timeout"  # no session.start within server.start_timeout_s; then CloseCode.POLICY
    IDLE_TIMEOUT = "idle_timeout"  # nothing from the client for server.idle_timeout_s; then CloseCode.POLICY
    CHANNEL_TAKEN = "channel_taken"  # session.start named a channel another session speaks on
    REPLY_CUT = "reply_cut"  # a reply (a say, or the responder's text) past reply.max_reply_chars: the rest not spoken
    CONVERSATION_LOST = "conversation_lost"  # another session resumed this session's conversation with its resume token
    CHANNEL_LOST = "channel_lost"  # a speaker whose channel another session took (its resume token, or the cluster)
    READ_ONLY = "read_only"  # a listener sent something other than ping
    ENDED_BY_OPERATOR = "ended_by_operator"  # the operator console ended the session; then CloseCode.NORMAL


class CloseCode(IntEnum):
    NORMAL = 1000
    GOING_AWAY = 1001  # server shutting down
    TRY_AGAIN_LATER = 1013  # busy: max_sessions reached
    POLICY = 1008  # a connection the server will not serve (e.g. a listener without a channel)
    TOO_BIG = 1009  # a message over MAX_MESSAGE_BYTES
    INTERNAL_ERROR = 1011  # /funasr: an engine failed on the stream (its error result was sent first)
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
    model_config = ConfigDict(extra="forbid", strict=True)


Name = Annotated[str, Field(min_length=1, max_length=64)]  # a voice, responder or language


class EndpointingUpdate(_Message):
    # What ends a turn: the end-of-turn model, or the silence rule; an endpoint_silence_ms alone
    # asks for the silence rule with that wait.
    turn: Literal["smart", "silence"] | None = None
    endpoint_silence_ms: int | None = Field(None, ge=100, le=5000)
    barge_in_min_ms: int | None = Field(None, ge=0, le=5000)


class SessionStart(_Message):
    type: Literal["session.start"]
    sample_rate: int = 16000
    voice: Name | None = None
    responder: Name | None = None
    language: Name | None = None
    channel: str | None = Field(None, pattern=f"^{CHANNEL_NAME.pattern}$")
    resume: str | None = Field(None, max_length=128)  # a previous session.ready's resume_token: continue its conversation
    endpointing: EndpointingUpdate | None = None
    # Cancel the bot's own voice from the input (voicebot/audio/echo.py); None: the endpoint's
    # default (on for /obs/audio, off for /v1/voice, where browsers cancel their own).
    echo_cancellation: bool | None = None


class SessionUpdate(_Message):
    type: Literal["session.update"]
    voice: Name | None = None
    responder: Name | None = None
    language: Name | None = None
    endpointing: EndpointingUpdate | None = None


class EndInput(_Message):
    """input.end: end the utterance in progress now (the session queues a messages.InputEnd)."""

    type: Literal["input.end"]


class Say(_Message):
    type: Literal["say"]
    text: str = Field(min_length=1, max_length=2000)
    interrupt: bool = False


class Interrupt(_Message):
    type: Literal["interrupt"]


class Ping(_Message):
    type: Literal["ping"]
    id: Annotated[str, Field(max_length=256)] | Annotated[int, Field(ge=-MAX_PING_ID, le=MAX_PING_ID)] | None = None


ClientMessage = Annotated[
    Union[SessionStart, SessionUpdate, EndInput, Say, Interrupt, Ping], Field(discriminator="type")
]
_client_message = TypeAdapter(ClientMessage)
ClientCommand = _Message  # every client message above: a command as Session.handle takes it
CLIENT_TYPES = ("session.start", "session.update", "input.end", "say", "interrupt", "ping")


def load_json(raw: str) -> Any:
    """Parse one text frame of any route under the input policy (module doc); raise ProtocolError."""
    if len(raw) > MAX_TEXT_CHARS:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"text frame of {len(raw)} characters is over the limit of {MAX_TEXT_CHARS}"
        )
    if _nesting_depth(raw) > MAX_JSON_DEPTH:
        raise ProtocolError(ErrorCode.UNSUPPORTED_JSON, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ProtocolError(ErrorCode.INVALID_JSON, f"text frame is not valid JSON: {exc.msg} at position {exc.pos}") from None
    _check_text(data)
    return data


def parse_text(raw: str) -> SessionStart | SessionUpdate | EndInput | Say | Interrupt | Ping:
    """Parse one /v1/voice text frame; raise ProtocolError with a code a client can switch on."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "a text frame must be a JSON object with a 'type'")
    kind = data.get("type")
    if kind not in CLIENT_TYPES:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {_short(kind)}; expected one of {', '.join(CLIENT_TYPES)}"
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


# A JSON string literal (escapes included): what _nesting_depth skips, since brackets in text are text.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def _nesting_depth(raw: str) -> int:
    """The deepest nesting of arrays and objects in `raw`, found without parsing it."""
    if raw.count("[") + raw.count("{") <= MAX_JSON_DEPTH:
        return 0  # cannot be deeper than the limit (the usual case: no scan)
    brackets = np.frombuffer(re.sub(r"[^\[\]{}]", "", _JSON_STRING.sub("", raw)).encode(), np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps).max(initial=0))


def _parse_int(literal: str) -> int:
    if len(literal) > MAX_NUMBER_CHARS:
        raise ProtocolError(ErrorCode.UNSUPPORTED_JSON, f"a number of {len(literal)} digits (at most {MAX_NUMBER_CHARS})")
    return int(literal)


def _parse_float(literal: str) -> float:
    value = float(literal) if len(literal) <= MAX_NUMBER_CHARS else math.inf
    if not math.isfinite(value):
        raise ProtocolError(ErrorCode.UNSUPPORTED_JSON, f"the number {_short(literal)} is too long or too large")
    return value


def _no_constant(name: str) -> None:
    raise ProtocolError(ErrorCode.INVALID_JSON, f"text frame is not valid JSON: {name} is not a JSON value")


def _check_text(value: Any) -> None:
    """Every string (keys too) must be Unicode text, so that any event echoing it can be encoded."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError(ErrorCode.UNSUPPORTED_JSON, "a string holds a lone surrogate (\\ud800-\\udfff): not Unicode text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_text(item)
    elif isinstance(value, list):
        for item in value:
            _check_text(item)


def _short(value: Any) -> str:
    """A value for an error message: its repr, cut to 80 characters (it is the client's input)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"][1:]) or "message"  # loc[0] is the union tag
        parts.append(f"field '{field}': {err['msg']}")
    return "; ".join(parts)


def audio_frame_limit(sample_rate: int) -> int:
    """The most bytes one binary frame of audio may hold: MAX_CHUNK_SECONDS at `sample_rate`."""
    return int(sample_rate * MAX_CHUNK_SECONDS) * 2


def check_audio(nbytes: int, sample_rate: int) -> None:
    """Validate one binary frame of s16le mono PCM."""
    if nbytes % 2:
        raise ProtocolError(ErrorCode.ODD_PCM_BYTES, f"binary frame has {nbytes} bytes; s16le PCM needs an even count")
    limit = audio_frame_limit(sample_rate)
    if nbytes > limit:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE,
            f"binary frame of {nbytes} bytes is over 1 s of audio at {sample_rate} Hz ({limit} bytes); send smaller chunks",
        )


# ---- server -> client -------------------------------------------------------------------------


# A session's events are typed (voicebot.session.events) and written by voicebot.frontends.voice.wire;
# these build what is sent outside a session: refusals before one starts, a channel's notices.


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event; `kind` is one of the types documented in docs/protocol.md."""
    return {"type": kind, **fields}


def error(code: str, message: str, **extra: Any) -> dict:
    return event("error", code=code, message=message, **extra)
