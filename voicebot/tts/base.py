"""The synthesizer interface.

A `Synthesizer` is loaded once at start-up and shared; `open(voice)` gives one session a
`SynthesisContext` holding that session's synthesis state (KV cache slot, token history, ...).
`stream()` takes the reply's text as it arrives (deltas, possibly one character at a time) and
yields `SpeechChunk`s of 24 kHz mono float32 audio as soon as each is ready. Cancelling the
consumer (barge-in) must stop the work promptly: engines check for cancellation between steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np

from voicebot.audio.rates import SPEAK_RATE
from voicebot.engine_reports import EngineInfo, ResetReport
from voicebot.serving.worker import Worker
from voicebot.tts.segmenter import sentences

SAMPLE_RATE = SPEAK_RATE  # every synthesizer's output


@dataclass(frozen=True)
class SpeechChunk:
    """Audio for part of a reply.

    `text` is the sentence (or text span) this audio voices, and `segment` its index within the
    reply; consecutive chunks of one segment share both. The pacer uses them to know which words
    the listener has heard when a reply is interrupted.
    """

    audio: np.ndarray  # float32, mono, SAMPLE_RATE
    text: str
    segment: int


@dataclass(frozen=True)
class VoiceInfo:
    name: str
    language: str | None = None
    description: str = ""


class SynthesisContext(ABC):
    voice: str

    @abstractmethod
    def stream(self, text: AsyncIterator[str]) -> AsyncIterator[SpeechChunk]:
        """Synthesize text deltas as they arrive; an async generator."""

    @abstractmethod
    def set_voice(self, voice: str) -> None:
        """Switch voice for the next reply (raises KeyError for an unknown voice)."""

    @abstractmethod
    async def reset(self) -> ResetReport:
        """Drop and rebuild this session's synthesis state (never called during a reply)."""

    @abstractmethod
    async def close(self) -> None: ...


class SentenceSynthesisContext(SynthesisContext):
    """For engines that speak a sentence at a time: the reply's text deltas are cut into sentences
    as they arrive (voicebot/tts/segmenter.py), and each sentence is one segment of the reply."""

    async def stream(self, text: AsyncIterator[str]) -> AsyncIterator[SpeechChunk]:
        segment = 0
        async for sentence in sentences(text):
            async for chunk in self.speak(sentence, segment):
                yield chunk
            segment += 1

    @abstractmethod
    def speak(self, sentence: str, segment: int) -> AsyncIterator[SpeechChunk]:
        """The audio of one sentence; an async generator."""


class Synthesizer(ABC):
    name: str

    @abstractmethod
    def load(self) -> None:
        """Load models and voices (blocking; called once at start-up, off the event loop)."""

    @abstractmethod
    def voices(self) -> list[VoiceInfo]: ...

    @abstractmethod
    def open(self, voice: str | None = None) -> SynthesisContext:
        """Per-session state; `voice` None means the configured default. KeyError if unknown."""

    def full(self) -> float | None:
        """None when one more session fits, else the seconds after which to retry. Only asks
        (/readyz reads it); engines without admission control always have room."""
        return None

    def admit(self) -> float | None:
        """Before open(): `full()`, counted as a refusal when it refuses (the caller answers `busy`)."""
        return self.full()

    @abstractmethod
    def info(self) -> EngineInfo: ...

    def register_metrics(self, registry) -> None:
        """Add the engine's own Prometheus collectors (a device scheduler's) to the app's registry."""

    def workers(self) -> list[Worker]:
        """The thread pools this engine runs on, for admission control (voicebot/serving/capacity.py).
        An engine that answers admission itself (a batching device scheduler) lists none."""
        return []

    def close(self) -> None:
        """Release shared resources at shutdown."""
