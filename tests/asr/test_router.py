"""The dialect fallback, driven through the models' weights (decoders biased to be sure or unsure)."""

from __future__ import annotations

import asyncio

import pytest

from tests.asr.tiny_models import synthetic_speech
from voicebot.asr.paraformer import ParaformerRecognizer
from voicebot.config.engines import DialectFallbackConfig, ParaformerConfig

AUDIO = synthetic_speech(3.0, seed=21)


def final_for(tiny_models, primary: str, offline: str | None = None, dialect: str = "streaming-sure",
              prefer: str = "higher_confidence", parallel: bool = False):
    config = ParaformerConfig(
        model=str(tiny_models[primary]),
        offline_model=str(tiny_models[offline]) if offline else None,
        dialect=DialectFallbackConfig(model=str(tiny_models[dialect]), prefer=prefer, parallel=parallel),
    )
    recognizer = ParaformerRecognizer(config)
    recognizer.load()

    async def utterance():
        stream = recognizer.open()
        for start in range(0, len(AUDIO), 4800):
            await stream.accept(AUDIO[start : start + 4800])
        return await stream.finish()

    try:
        return asyncio.run(utterance())
    finally:
        recognizer.close()


def test_unsure_primary_falls_back_and_reports_both(tiny_models):
    final = final_for(tiny_models, "streaming-unsure")
    assert final.fallback is not None
    assert final.fallback.model == "asr.paraformer.dialect.model" and final.fallback.confidence > 0.9
    # The dialect result was more confident, so it is the one used.
    assert final.model == final.fallback.model and final.text == final.fallback.text
    event = final.to_event()
    assert set(event) == {"text", "confidence", "model", "fallback"}
    assert set(event["fallback"]) == {"text", "confidence", "model"}


def test_sure_primary_does_not_fall_back(tiny_models):
    final = final_for(tiny_models, "streaming-sure")
    assert final.confidence > 0.7 and final.fallback is None and final.model == "asr.paraformer.model"


def test_offline_pass_decides_when_configured(tiny_models):
    # An unsure streaming pass does not trigger the fallback when the offline pass is sure...
    final = final_for(tiny_models, "streaming-unsure", offline="offline-sure")
    assert final.model == "asr.paraformer.offline_model" and final.fallback is None
    # ...and a sure streaming pass does not prevent it when the offline pass is unsure.
    final = final_for(tiny_models, "streaming-sure", offline="offline-unsure")
    assert final.fallback is not None and final.model == "asr.paraformer.dialect.model"


@pytest.mark.parametrize("prefer, expected", [("higher_confidence", "asr.paraformer.model"),
                                              ("dialect", "asr.paraformer.dialect.model")])
def test_prefer_rule_with_a_less_sure_dialect(tiny_models, prefer, expected):
    # Random weights (unsure) as primary, flattened ones (even less sure) as dialect.
    final = final_for(tiny_models, "streaming", dialect="streaming-unsure", prefer=prefer)
    assert final.fallback.confidence < 0.7 and final.model == expected


def test_parallel_dialect_stream_gives_the_same_result_without_a_decode(tiny_models, monkeypatch):
    from voicebot.asr.funasr_model import FunasrModel

    decodes = []
    original = FunasrModel.decode

    async def counted(self, audio):
        decodes.append(self.name)
        return await original(self, audio)

    monkeypatch.setattr(FunasrModel, "decode", counted)
    at_endpoint = final_for(tiny_models, "streaming-unsure")
    assert decodes == ["asr.paraformer.dialect.model"]
    decodes.clear()
    parallel = final_for(tiny_models, "streaming-unsure", parallel=True)
    assert decodes == []  # the dialect result was ready at the endpoint
    assert parallel == at_endpoint


def test_parallel_needs_a_streaming_dialect_model(tiny_models):
    config = ParaformerConfig(model=str(tiny_models["streaming"]),
                              dialect=DialectFallbackConfig(model=str(tiny_models["offline"]), parallel=True))
    with pytest.raises(ValueError, match="streaming dialect model"):
        ParaformerRecognizer(config).load()
