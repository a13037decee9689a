"""`asr.engine: paraformer-batched` against `paraformer` (funasr) through the same session code:
the same partials, final text and token confidences; sessions at once share model calls; and a
real /v1/voice session on it, with the dialect fallback (a streaming model, batched too)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.asr.tiny_models import synthetic_speech
from tests.conftest import VoiceClient, make_settings, running_server, speech_pcm
from voicebot.asr.paraformer import BatchedParaformerRecognizer, ParaformerRecognizer
from voicebot.asr.sanm.engine import BatchedStreamingModel
from voicebot.config.engines import ParaformerConfig


async def _session(recognizer, audio: np.ndarray, piece: int) -> tuple[list[str], object]:
    stream = recognizer.open()
    partials = []
    for start in range(0, len(audio), piece):
        partial = await stream.accept(audio[start: start + piece])
        if partial is not None:
            partials.append(partial)
    final = await stream.finish()
    await stream.close()
    return partials, final


@pytest.fixture(scope="module")
def engines(tiny_models):
    config = ParaformerConfig(model=str(tiny_models["streaming"]), offline_model=str(tiny_models["offline"]))
    funasr_engine, ours = ParaformerRecognizer(config), BatchedParaformerRecognizer(config)
    funasr_engine.load()
    ours.load()
    yield funasr_engine, ours
    funasr_engine.close()
    ours.close()


def test_same_partials_text_and_confidences_as_the_funasr_engine(engines):
    funasr_engine, ours = engines
    assert isinstance(ours.streaming, BatchedStreamingModel) and ours.router.offline is not None
    audios = [synthetic_speech(s, seed=300 + i) for i, s in enumerate([3.1, 1.4, 4.6])]

    async def sessions(recognizer):  # three sessions at once, pieces of different sizes
        return await asyncio.gather(*(_session(recognizer, a, p) for a, p in zip(audios, [9600, 3000, 16000])))

    theirs = asyncio.run(sessions(funasr_engine))
    mine = asyncio.run(sessions(ours))
    for (their_partials, their_final), (my_partials, my_final) in zip(theirs, mine):
        assert my_partials == their_partials and their_partials
        # The final is the offline second pass's (funasr in both engines); the streamed text
        # decided the partials above.
        assert my_final.text == their_final.text
        assert my_final.confidence == pytest.approx(their_final.confidence, abs=1e-5)
    assert max(ours.streaming.worker.batch_sizes) > 1, "the sessions' chunks shared model calls"
    assert ours.workers() == [ours.streaming.worker]
    counts = ours.info().details["batchers"][ours.streaming.worker.name]  # what /readyz shows
    assert counts["batch_sizes"] == dict(sorted(ours.streaming.worker.batch_sizes.items()))
    assert counts["refused"] == counts["failed_requests"] == counts["thread_faults"] == 0 and counts["pending"] == 0


def test_streamed_confidences_match_funasr(tiny_models):
    config = ParaformerConfig(model=str(tiny_models["streaming"]))
    funasr_engine, ours = ParaformerRecognizer(config), BatchedParaformerRecognizer(config)
    funasr_engine.load()
    ours.load()
    try:
        audio = synthetic_speech(3.7, seed=9)
        _, theirs = asyncio.run(_session(funasr_engine, audio, 9600))
        _, mine = asyncio.run(_session(ours, audio, 9600))
        assert mine.text == theirs.text != ""
        assert mine.confidence == pytest.approx(theirs.confidence, abs=1e-5)
    finally:
        funasr_engine.close()
        ours.close()


def test_voice_session_with_the_dialect_fallback_on_the_batched_engine(tiny_models):
    settings = make_settings(asr={"engine": "paraformer-batched", "paraformer": {
        "model": str(tiny_models["streaming-unsure"]),
        "dialect": {"model": str(tiny_models["streaming-sure"]), "parallel": True},
    }})

    async def talk(url: str):
        async with VoiceClient.connect(url) as client:
            await client.stream(speech_pcm("今天天气很好"), speed=4)
            return client, await client.wait_for("asr.final")

    with running_server(settings) as server:
        client, final = asyncio.run(talk(server.ws_url))
    assert client.of_type("asr.partial"), "partials while speaking"
    assert final["model"] == "asr.paraformer.dialect.model" and final["confidence"] > 0.9
