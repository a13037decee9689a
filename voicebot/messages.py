"""The messages that travel the data path, in the order a chunk meets them.

    socket ─► AudioIn / InputEnd ─► listening ─► Utterance ─► Turn ─► replying
        replying: responder ─► text deltas (str) ─► TTS ─► SpeechChunk ─► framer ─► AudioFrame
    socket ◄── front end ◄── session.events (typed events) / AudioFrame (the outbox)

Each is a small frozen value: a stage hands it on and keeps no reference to it. What a stage
keeps between messages (resampler state, the open utterance, a reply's pacer) lives in the stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from voicebot.asr.base import Hypothesis
from voicebot.tts.base import SpeechChunk

__all__ = ["AudioIn", "InputEnd", "DropUtterance", "Inbound", "Utterance", "Turn", "SpeechChunk", "AudioFrame"]


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
class DropUtterance:
    """The client cleared its input (the ClearInput command), queued in order with the audio before
    it: drop the utterance in progress."""


Inbound = AudioIn | InputEnd | DropUtterance


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


@dataclass(frozen=True)
class AudioFrame:
    """One 200 ms frame of reply audio, s16le mono at SPEAK_RATE (the last of a reply may be shorter)."""

    pcm: bytes
