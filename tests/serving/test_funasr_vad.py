"""/funasr clients on the real server's VAD batcher, beside /v1/voice sessions (the default
config: pocketsphinx and the Silero endpointer, no fsmn-vad)."""

from __future__ import annotations

import asyncio
import json

import websockets

from tests.conftest import (
    TEST_PHRASES,
    VoiceClient,
    make_settings,
    running_server,
    speech_pcm,
)

CHUNK = 3200  # bytes: 100 ms of 16 kHz s16le, as the runtime's clients send


async def funasr_transcript(url: str, pcm: bytes) -> str:
    """One offline /funasr stream sent in real-time-ish pieces; its final text."""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"mode": "offline", "wav_name": "t", "wav_format": "pcm", "audio_fs": 16000,
                                  "is_speaking": True}))
        for start in range(0, len(pcm), CHUNK):
            await ws.send(pcm[start : start + CHUNK])
            await asyncio.sleep(0.025)
        await ws.send(json.dumps({"is_speaking": False}))
        texts = []
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert "error" not in message, message
            texts.append(message["text"])
            if message["is_final"]:
                return " ".join(t for t in texts if t)


def test_funasr_clients_share_the_vad_batcher_with_sessions_and_one_gone_mid_chunk_stops_nobody():
    with running_server(make_settings(endpoint={"turn": "silence"})) as server:
        url = f"ws://127.0.0.1:{server.settings.server.port}/funasr"
        batcher = server.runtime.vad
        phrases = TEST_PHRASES[1:4]
        alone = asyncio.run(funasr_transcript(url, speech_pcm(phrases[0])))
        busy_before, calls_before = batcher.busy_s, dict(batcher.batch_sizes)

        async def gone_mid_chunk():
            """Sends 1 s of speech and closes at once: its windows are still waiting or being judged."""
            async with websockets.connect(url) as ws:
                await ws.send(json.dumps({"mode": "2pass", "wav_format": "pcm", "audio_fs": 16000, "is_speaking": True}))
                await ws.send(speech_pcm(phrases[2])[:32000])

        async def voice():
            async with VoiceClient.connect(server.ws_url) as c:
                await c.stream(speech_pcm(phrases[1]))
                return (await c.wait_for("asr.final"))["text"]

        async def together():
            return await asyncio.gather(*(funasr_transcript(url, speech_pcm(phrases[0])) for _ in range(2)),
                                        voice(), *(gone_mid_chunk() for _ in range(3)))

        first, second, heard, *_ = asyncio.run(together())
        after = asyncio.run(funasr_transcript(url, speech_pcm(phrases[2])))
        shared = {rows: n - calls_before.get(rows, 0) for rows, n in batcher.batch_sizes.items()}
        vad_thread_alive = batcher._thread.is_alive()
        busy_after = batcher.busy_s
    assert alone == phrases[0] and first == second == alone  # judged as alone, with others in its calls
    assert heard == phrases[1] and after == phrases[2]
    assert any(rows > 1 and n > 0 for rows, n in shared.items())  # /funasr and /v1/voice windows in one call
    assert busy_after > busy_before and vad_thread_alive  # its CPU counts in the batcher's load
