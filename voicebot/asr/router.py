"""What happens at an endpoint after the streaming pass: second pass and dialect fallback.

1. Second pass (optional): an offline Paraformer re-decodes the utterance's audio. Its result
   replaces the streamed one: it is more accurate and its posteriors are better calibrated.
2. Fallback (optional): when the deciding confidence (the offline pass's when there is one, else
   the streaming pass's) is below the threshold, the dialect model's result is used: decoded from
   the utterance's audio now, or, with `parallel`, already streamed alongside the primary. A rule
   picks the result. The event carries the chosen result plus the dialect's in `fallback`.

An utterance with no tokens has no confidence and never falls back: nothing was recognised
with which to be unsure, and a dialect decode of every cough would cost time for nothing.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Literal

import numpy as np

from voicebot.asr.base import Hypothesis
from voicebot.asr.funasr_model import Decoded, FunasrModel, utterance_confidence

log = logging.getLogger(__name__)

Prefer = Literal["higher_confidence", "dialect"]


def to_hypothesis(decoded: Decoded, model: str) -> Hypothesis:
    geo_mean, minimum = utterance_confidence(decoded.token_confidences)
    return Hypothesis(
        text=decoded.text,
        confidence=geo_mean,
        model=model,
        min_token_confidence=minimum,
        token_count=len(decoded.token_confidences),
    )


class Router:
    def __init__(
        self,
        offline: FunasrModel | None = None,
        dialect: FunasrModel | None = None,
        threshold: float = 0.7,
        prefer: Prefer = "higher_confidence",
        parallel: bool = False,
    ) -> None:
        if parallel and dialect is not None and not dialect.streaming:
            raise ValueError(f"dialect.parallel needs a streaming dialect model; {dialect.path} is a {dialect.class_name}")
        self.offline = offline
        self.dialect = dialect
        self.threshold = threshold
        self.prefer = prefer
        self.parallel = parallel and dialect is not None

    @property
    def needs_audio(self) -> bool:
        return self.offline is not None or (self.dialect is not None and not self.parallel)

    async def finalize(self, streamed: Hypothesis, audio: np.ndarray | None, dialect_pass: Decoded | None = None) -> Hypothesis:
        """The utterance's final hypothesis; `dialect_pass` is the parallel dialect stream's result."""
        primary = streamed
        if self.offline is not None:
            primary = to_hypothesis(await self.offline.decode(audio), self.offline.name)
        if self.dialect is None or primary.confidence is None or primary.confidence >= self.threshold:
            return primary

        decoded = dialect_pass if dialect_pass is not None else await self.dialect.decode(audio)
        alternative = to_hypothesis(decoded, self.dialect.name)
        use_dialect = self.prefer == "dialect" or (alternative.confidence or 0.0) > primary.confidence
        # The session logs and counts the result it gets; the losing primary is only visible here.
        log.info(
            "asr fallback: primary %s %.3f %r | dialect %s %s %r -> %s",
            primary.model, primary.confidence, primary.text, alternative.model,
            "none" if alternative.confidence is None else f"{alternative.confidence:.3f}",
            alternative.text, "dialect" if use_dialect else "primary",
        )
        chosen = alternative if use_dialect else primary
        return replace(chosen, fallback=alternative)
