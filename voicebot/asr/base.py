"""The recognizer interface.

A `Recognizer` is loaded once at start-up and shared by every session; `open()` gives one
session its own `RecognizerStream`. Audio reaching a stream has already been resampled to
16 kHz float32 in [-1, 1], gated and endpointed: `accept` is called only for audio inside an
utterance, `finish` once at each endpoint. Blocking model work happens off the event loop
(see voicebot/serving/worker.py), so every method that may compute is a coroutine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from voicebot.audio.rates import LISTEN_RATE
from voicebot.engine_reports import EngineInfo, ResetReport
from voicebot.serving.worker import Worker

SAMPLE_RATE = LISTEN_RATE  # what every recognizer hears


@dataclass(frozen=True)
class Hypothesis:
    text: str
    # Geometric mean of per-token posteriors in [0, 1]; None when the engine has no such measure.
    confidence: float | None
    model: str
    min_token_confidence: float | None = None
    token_count: int = 0
    # Set by the router when a second model re-decoded the utterance.
    fallback: "Hypothesis | None" = None

    def to_event(self) -> dict:
        return {
            "text": self.text,
            "confidence": self.confidence,
            "model": self.model,
            "fallback": None
            if self.fallback is None
            else {"text": self.fallback.text, "confidence": self.fallback.confidence, "model": self.fallback.model},
        }


class RecognizerStream(ABC):
    @abstractmethod
    async def accept(self, pcm: np.ndarray) -> str | None:
        """Feed 16 kHz float32 audio of the current utterance.

        Returns the whole partial transcript of the utterance so far when it changed, else None.
        """

    @abstractmethod
    async def finish(self) -> Hypothesis:
        """End the utterance: flush, return the final hypothesis, and clear per-utterance state."""

    @abstractmethod
    async def reset(self) -> ResetReport:
        """Drop and rebuild everything this stream keeps between utterances (periodic reset)."""

    @abstractmethod
    async def close(self) -> None:
        """Release the stream's state; called once when the session ends."""


class Recognizer(ABC):
    name: str

    @abstractmethod
    def load(self) -> None:
        """Load models (blocking; called once at start-up, off the event loop)."""

    @abstractmethod
    def open(self, language: str | None = None) -> RecognizerStream:
        """A new stream for one session."""

    @abstractmethod
    def info(self) -> EngineInfo: ...

    def full(self) -> float | None:
        """None when a new stream fits without slowing the others, else the seconds after which to
        retry (admission answers `busy`, reason `decoders`: pocketsphinx's decoders)."""
        return None

    def workers(self) -> list[Worker]:
        """The thread pools this engine runs on, for admission control (voicebot/serving/capacity.py).
        An engine that answers admission itself (a batching device scheduler) lists none."""
        return []

    def register_metrics(self, registry) -> None:
        """Add the engine's own Prometheus collectors (pocketsphinx's decoding processes) to the app's registry."""

    def close(self) -> None:
        """Release shared resources at shutdown."""
