"""What a front end may ask of a session: the session's typed door in (`Session.handle`).

/v1/voice's own messages are commands as they are parsed (voicebot.protocol: SessionStart,
SessionUpdate, EndInput, Say, Interrupt, Ping); the ones below have no /v1/voice message: audio
(a binary frame there), and what OpenAI's Realtime protocol asks that /v1/voice does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from voicebot.protocol import EndInput, Interrupt, Ping, Say, SessionStart, SessionUpdate


@dataclass(frozen=True)
class AudioChunk:
    """s16le mono PCM at the session's declared rate, at most protocol.MAX_CHUNK_SECONDS of it."""

    pcm: bytes


@dataclass(frozen=True)
class AnswerText:
    """Reply to this text as to something the user said (a typed user message)."""

    text: str


@dataclass(frozen=True)
class SetInstructions:
    """The responder's system prompt for this conversation; None: the configured persona."""

    text: str | None


@dataclass(frozen=True)
class SetVadThreshold:
    """The VAD's speech probability threshold for this session (0-1, exclusive)."""

    threshold: float


@dataclass(frozen=True)
class TruncateReply:
    """The client played `audio_end_ms` of reply `reply_id`: stop it there if it still plays, and
    keep only what was heard in the conversation. Answered with ReplyTruncated, or TruncateRefused
    when the reply is not the latest."""

    reply_id: str
    audio_end_ms: int


@dataclass(frozen=True)
class ClearInput:
    """Drop the utterance in progress once the audio sent before this is heard; answered with
    InputCleared."""


Command = (SessionStart | SessionUpdate | EndInput | Say | Interrupt | Ping | AudioChunk | AnswerText | SetInstructions
           | SetVadThreshold | TruncateReply | ClearInput)
