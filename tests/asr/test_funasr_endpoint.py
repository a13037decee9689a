"""funasr-client (async API) against the server's /funasr on 127.0.0.1, in all three modes.

The real app: tiny Paraformer as `asr.engine: paraformer`, the server's Silero endpointer, and
espeak-ng Mandarin speech with pauses, so utterances end by VAD as well as by the client.
"""

from __future__ import annotations

import asyncio
import threading
import time
import wave

import numpy as np
import pytest
import uvicorn

from tests.audio import espeak_speech, to_pcm16
from voicebot.app import create_app
from voicebot.config import Settings


@pytest.fixture(scope="module")
def server_url(tiny_models):
    settings = Settings(asr={"engine": "paraformer", "paraformer": {"model": str(tiny_models["streaming"])}},
                        tts={"voice": "zh"})
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"ws://127.0.0.1:{port}/funasr"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def wav_path(tmp_path_factory):
    silence = np.zeros(16000, np.float32)
    speech = [espeak_speech(text, voice="cmn") for text in ("今天天气很好", "我们去公园散步吧")]
    audio = np.concatenate([silence[:4000], speech[0], silence, speech[1], silence])
    path = tmp_path_factory.mktemp("funasr-client") / "two-sentences.wav"
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(16000)
        wav.writeframes(to_pcm16(audio))
    return path


def stream(url: str, path, mode: str) -> list[dict]:
    from funasr_client import async_file_asr_stream

    async def run():
        return [m async for m in async_file_asr_stream(path, url, mode=mode)]

    return asyncio.run(asyncio.wait_for(run(), 60))


def well_formed(messages: list[dict], modes: set[str]) -> None:
    assert messages, "no messages"
    for message in messages:
        assert message["mode"] in modes and message["wav_name"] == "two-sentences.wav"
        assert isinstance(message["text"], str) and isinstance(message["is_final"], bool)
    assert messages[-1]["is_final"] and not any(m["is_final"] for m in messages[:-1])


def test_2pass(server_url, wav_path):
    messages = stream(server_url, wav_path, "2pass")
    well_formed(messages, {"2pass-online", "2pass-offline"})
    finals = [m for m in messages if m["mode"] == "2pass-offline" and m["text"]]
    assert len(finals) == 2  # two sentences, two VAD endpoints
    assert any(m["mode"] == "2pass-online" for m in messages)
    assert all(0 < m["confidence"] <= 1 and m["asr_model"] == "asr.paraformer.model" for m in finals)


def test_online(server_url, wav_path):
    messages = stream(server_url, wav_path, "online")
    well_formed(messages, {"online"})
    assert len([m for m in messages if m["text"]]) >= 2


def test_runtime_clients_root_path(server_url, wav_path):
    # The runtime's own clients cannot add a path: they connect to ws://host:port/.
    root = server_url.removesuffix("funasr")
    well_formed(stream(root, wav_path, "2pass"), {"2pass-online", "2pass-offline"})


def test_offline(server_url, wav_path):
    from funasr_client import async_file_asr

    messages = stream(server_url, wav_path, "offline")
    well_formed(messages, {"offline"})
    assert len([m for m in messages if m["text"]]) == 2
    merged = asyncio.run(asyncio.wait_for(async_file_asr(wav_path, server_url, mode="2pass"), 60))
    assert merged["text"] and merged["is_final"]


def test_a_client_that_ends_twice_and_closes_leaves_no_traceback(server_url, caplog):
    # Every way a socket ends is handled by the one receive loop (voicebot/transport.py); a client
    # that sends its end twice and closes at once must not show up as an error in the server log.
    import websockets

    async def run():
        async with websockets.connect(server_url) as ws:
            await ws.send('{"mode": "offline", "wav_name": "w", "is_speaking": true}')
            await ws.send(to_pcm16(np.zeros(8000, np.float32)))
            await ws.send('{"is_speaking": false}')
            await ws.send('{"is_speaking": false}')
        await asyncio.sleep(0.5)  # the server reads, answers into the closed socket, and ends

    with caplog.at_level("DEBUG"):
        asyncio.run(asyncio.wait_for(run(), 30))
    assert not [r for r in caplog.records if r.exc_info or r.levelname in ("ERROR", "CRITICAL")], caplog.text
