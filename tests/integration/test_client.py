"""The reference client against the real server, and the shared token on every kind of connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import wave

import pytest
import websockets

from tests.browser.support import speech, write_wav
from tests.conftest import make_settings, running_server, speech_pcm
from voicebot.client import converse, wav_chunks

TOKEN = "a-shared-secret"


def test_round_trip_of_a_wav_file(server, tmp_path):
    question = write_wav(tmp_path / "question.wav", speech(0.3, "hello there how are you", 1.0, rate=22050), rate=22050)
    reply = tmp_path / "reply.wav"
    done = subprocess.run(
        [sys.executable, "-m", "voicebot.client", "--url", server.ws_url, "--wav", str(question), "--out", str(reply), "--linger", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert events[0]["type"] == "session.ready" and events[0]["input_sample_rate"] == 22050
    assert [e["text"] for e in events if e["type"] == "asr.final"] == ["hello there how are you"]
    end = next(e for e in events if e["type"] == "audio.end")
    with wave.open(str(reply)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() == end["samples"]  # every frame of the reply, nothing else
    assert "wrote" in done.stderr


@pytest.fixture(scope="module")
def token_server():
    with running_server(make_settings()) as server:
        # Set after running_server's warm-up, which connects without a token; the app reads the
        # setting on every connection.
        server.settings.server.token = TOKEN
        yield server


async def first_event(url: str, **connect) -> tuple[dict, int | None]:
    """Connect, start a session (or listen), return the first event and the close code, if closed."""
    async with websockets.connect(url, **connect) as ws:
        if "role=listener" not in url:
            with contextlib.suppress(websockets.ConnectionClosed):  # a refused one may be closed already
                await ws.send(json.dumps({"type": "session.start"}))
        event = json.loads(await ws.recv())
        with contextlib.suppress(websockets.ConnectionClosed, asyncio.TimeoutError):
            await asyncio.wait_for(ws.recv(), 1)
    return event, ws.close_code


def test_the_token_is_checked_before_anything_else(token_server):
    url = token_server.ws_url
    listen = f"{url}?role=listener&channel=main"
    ok = [
        first_event(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}),
        first_event(f"{url}?token={TOKEN}"),
        first_event(url, subprotocols=["voicebot", f"token.{TOKEN}"]),
        first_event(f"{listen}&token={TOKEN}"),
    ]
    refused = [
        first_event(url),
        first_event(f"{url}?token=wrong-token"),
        first_event(listen),
        first_event(url.replace("/v1/voice", "/obs/audio?channel=main")),
    ]

    async def run(calls):
        return [await c for c in calls]

    for event, _ in asyncio.run(run(ok)):
        assert event["type"] in ("session.ready", "listener.ready")
    for event, close_code in asyncio.run(run(refused)):
        assert event["code"] == "unauthorized" and close_code == 4401
    assert token_server.metric("voicebot_sessions_refused_total", 'reason="unauthorized"') == 4


def test_converse_with_the_token(token_server):
    pcm = speech_pcm("stop talking now")
    result = asyncio.run(converse(token_server.ws_url, wav_chunks(pcm, 16000), 16000, token=TOKEN, linger_s=1.0))
    assert [e["text"] for e in result.events if e["type"] == "asr.final"] == ["stop talking now"]
    assert len(result.reply_audio) > 0 and len(result.reply_audio) % 2 == 0
