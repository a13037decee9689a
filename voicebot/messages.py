"""The messages that travel the data path, in the order a chunk meets them.

    socket ─► AudioIn / InputEnd ─► listening ─► Utterance ─► Turn ─► replying
        replying: responder ─► text deltas (str) ─► TTS ─► SpeechChunk ─► framer ─► AudioFrame
    socket ◄── Event / AudioFrame (the outbox)

Each is a small frozen value: a stage hands it on and keeps no reference to it. What a stage
keeps between messages (resampler state, the open utterance, a reply's pacer) lives in the stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from voicebot.asr.base import Hypothesis
from voicebot.tts.base import SpeechChunk

__all__ = ["AudioIn", "InputEnd", "ClearInput", "Inbound", "Utterance", "Turn", "SpeechChunk", "Event", "AudioFrame", "Outbound"]


@dataclass(frozen=True)
class AudioIn:
    """One binary message from the client: s16le mono PCM at the session's declared rate."""

    pcm: bytes
    arrived: float  # monotonic time it came off the socket: the origin of the latencies we report


@dataclass(frozen=True)
class InputEnd:
    """The client's input.end, queued in order with the audio before it: end the utterance now."""

    arrived: float


@dataclass(frozen=True)
class ClearInput:
    """The client cleared its input (/v1/realtime's input_audio_buffer.clear), queued in order with
    the audio before it: drop the utterance in progress."""


Inbound = AudioIn | InputEnd | ClearInput


@dataclass(frozen=True)
class Utterance:
    """What the listening stage returns at each endpoint: one thing the user said, recognized."""

    id: str  # "u1", "u2", ... within the session
    hypothesis: Hypothesis
    speech_end: float  # monotonic time the user stopped talking (the arrival of that audio)
    speech_ms: float
    gate_muted_ms: int  # input the noise gate muted inside this utterance
    endpoint_delay_s: float  # end of speech to the endpoint decision
    asr_final_s: float  # endpoint decision to the final transcript

    @property
    def text(self) -> str:
        return self.hypothesis.text


@dataclass(frozen=True)
class Turn:
    """A reply to make: to what the user said (via the responder), or a `say` text spoken as is."""

    text: str
    say: bool
    speech_end: float | None = None  # monotonic time the user stopped talking
    utterance_id: str | None = None

    @classmethod
    def answering(cls, utterance: Utterance) -> "Turn":
        return cls(utterance.text, say=False, speech_end=utterance.speech_end, utterance_id=utterance.id)


@dataclass(frozen=True)
class Event:
    """A JSON event for the client (protocol.event / protocol.error build the payload)."""

    payload: dict[str, Any]

    @property
    def wire(self) -> str:
        return json.dumps(self.payload, ensure_ascii=False)


@dataclass(frozen=True)
class AudioFrame:
    """One 200 ms frame of reply audio, s16le mono at SPEAK_RATE (the last of a reply may be shorter)."""

    pcm: bytes

    @property
    def wire(self) -> bytes:
        return self.pcm


Outbound = Event | AudioFrame
