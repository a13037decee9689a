"""The paraformer engine inside a real /v1/voice session: asr.final carries the router's result."""

from __future__ import annotations

import asyncio

from tests.conftest import VoiceClient, make_settings, running_server, speech_pcm


def test_asr_final_reports_the_fallback(tiny_models):
    settings = make_settings(asr={"engine": "paraformer", "paraformer": {
        "model": str(tiny_models["streaming-unsure"]),
        "dialect": {"model": str(tiny_models["streaming-sure"])},
    }})

    async def talk(url: str):
        async with VoiceClient.connect(url) as client:
            await client.stream(speech_pcm("今天天气很好"), speed=4)
            return client, await client.wait_for("asr.final")

    with running_server(settings) as server:
        client, final = asyncio.run(talk(server.ws_url))
    assert client.of_type("asr.partial"), "partials while speaking"
    assert final["model"] == "asr.paraformer.dialect.model" and final["confidence"] > 0.9
    assert final["fallback"] == {"text": final["text"], "confidence": final["confidence"], "model": final["model"]}
