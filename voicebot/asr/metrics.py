"""Prometheus metrics of the FunASR recognizer and its router (exposed by the app's /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

CONFIDENCE = Histogram(
    "voicebot_asr_confidence",
    "Utterance confidence (geometric mean of token posteriors) per model and pass",
    ["model", "stage"],  # stage: streaming | offline | fallback
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
)
FALLBACKS = Counter(
    "voicebot_asr_fallback_total",
    "Utterances re-decoded by the dialect model, by which result was used",
    ["chosen"],  # primary | dialect
)
SECOND_PASS_SECONDS = Histogram(
    "voicebot_asr_second_pass_seconds",
    "Time added at the endpoint by the offline pass and the dialect fallback",
    ["stage"],  # offline | fallback
    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2),
)
