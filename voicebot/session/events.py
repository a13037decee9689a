"""What a session says: one frozen type per server event kind, the session's typed door out.

The stages put these (and reply audio as voicebot.messages.AudioFrame) on the outbox; each front
end turns them into its own wire: /v1/voice's JSON in voicebot.frontends.voice.wire (the field
order here is the wire's order), OpenAI Realtime events in voicebot.frontends.realtime_events.
docs/protocol.md documents every kind and field. `kind` is the /v1/voice `type`.

A field marked `flat` holds a dict whose keys sit at the top of the event on the wire (an error's
details, a transcript's hypothesis): `wire` spreads it where the field stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from voicebot.messages import AudioFrame

FLAT = {"flat": True}


@dataclass(frozen=True)
class SessionReady:
    kind: ClassVar[str] = "session.ready"
    session_id: str
    resume_token: str  # only for this client: never mirrored to a channel's listeners
    protocol_version: int
    input_sample_rate: int
    output_sample_rate: int
    frame_ms: int
    voice: str
    responder: str
    resumed: bool


@dataclass(frozen=True)
class SessionUpdated:
    kind: ClassVar[str] = "session.updated"
    voice: str
    responder: str
    language: str | None
    turn: str  # "smart" or "silence": what ends a turn now
    endpoint_silence_ms: int
    barge_in_min_ms: int


@dataclass(frozen=True)
class Pong:
    kind: ClassVar[str] = "pong"
    id: str | int | None


@dataclass(frozen=True)
class Error:
    kind: ClassVar[str] = "error"
    code: str  # voicebot.protocol.ErrorCode
    message: str
    details: dict[str, Any] = field(default_factory=dict, metadata=FLAT)  # reply_id, engine, retry_after_s, ...


@dataclass(frozen=True)
class SpeechStarted:
    kind: ClassVar[str] = "speech.started"
    utterance_id: str


@dataclass(frozen=True)
class AsrPartial:
    kind: ClassVar[str] = "asr.partial"
    utterance_id: str
    text: str


@dataclass(frozen=True)
class AsrFinal:
    kind: ClassVar[str] = "asr.final"
    utterance_id: str
    hypothesis: dict[str, Any] = field(metadata=FLAT)  # Hypothesis.to_event(): text, confidence, model, fallback
    gate_muted_ms: int
    timings: dict[str, Any]


@dataclass(frozen=True)
class InputCleared:
    kind: ClassVar[str] = "input.cleared"
    utterance_id: str | None  # the utterance dropped, if one was open


@dataclass(frozen=True)
class TurnEnd:
    kind: ClassVar[str] = "turn.end"
    utterance_id: str
    by: str
    probability: float | None
    text: str
    timings: dict[str, Any]


@dataclass(frozen=True)
class ReplyDelta:
    kind: ClassVar[str] = "reply.delta"
    reply_id: str
    text: str


@dataclass(frozen=True)
class ReplyDone:
    kind: ClassVar[str] = "reply.done"
    reply_id: str
    text: str


@dataclass(frozen=True)
class AudioStart:
    kind: ClassVar[str] = "audio.start"
    reply_id: str
    sample_rate: int
    frame_ms: int


@dataclass(frozen=True)
class AudioEnd:
    kind: ClassVar[str] = "audio.end"
    reply_id: str
    frames: int
    samples: int
    timings: dict[str, Any]


@dataclass(frozen=True)
class AudioInterrupted:
    kind: ClassVar[str] = "audio.interrupted"
    reply_id: str
    reason: str
    frames_sent: int
    frames_dropped: int
    played_ms: int
    heard_text: str


@dataclass(frozen=True)
class ReplyTruncated:
    """A TruncateReply done: the conversation keeps `heard_text` of the reply (/v1/realtime only)."""

    kind: ClassVar[str] = "reply.truncated"
    reply_id: str
    audio_end_ms: int
    heard_text: str


@dataclass(frozen=True)
class TruncateRefused:
    """A TruncateReply of a reply that is not the latest one (/v1/realtime only)."""

    kind: ClassVar[str] = "reply.truncate_refused"
    reply_id: str


@dataclass(frozen=True)
class StateReset:
    kind: ClassVar[str] = "state.reset"
    reason: str
    duration_ms: float
    engines: list[dict[str, Any]]
    skipped: list[str]


ServerEvent = (SessionReady | SessionUpdated | Pong | Error | SpeechStarted | AsrPartial | AsrFinal | InputCleared | TurnEnd
               | ReplyDelta | ReplyDone | AudioStart | AudioEnd | AudioInterrupted | ReplyTruncated | TruncateRefused
               | StateReset)
Outbound = ServerEvent | AudioFrame  # what the outbox holds, in order
