"""The real server with the tiny CosyVoice 2 model: a fault raised into the device scheduler's
thread ends only the replies it hit, with an `error` event, and the next turn is spoken."""

from __future__ import annotations

import asyncio
import ctypes

import pytest

from bench.serve import make_model_and_voice
from tests.conftest import VoiceClient, make_settings, running_server
from tests.cosyvoice2.test_server import fixed_length  # noqa: F401 (a fixture: replies of a certain length)


@pytest.fixture
def server(tmp_path, fixed_length):  # noqa: F811
    model_dir, voices = make_model_and_voice(tmp_path)
    settings = make_settings(tts={"engine": "cosyvoice2", "voice": "bench", "cosyvoice2": {
        "model": str(model_dir), "voices_dir": str(voices), "voice_cache_dir": str(tmp_path / "cache"), "device": "cpu",
        "kv_cache_tokens": 512}})
    with running_server(settings) as srv:
        yield srv


def faults(server) -> float:
    name = server.runtime.synthesizer.scheduler.name
    return server.metric("voicebot_scheduler_thread_faults_total", f'scheduler="{name}"')


async def say(client: VoiceClient, text: str, ends: int) -> dict:
    await client.send({"type": "say", "text": text})
    return await client.wait_for("audio.end", count=ends, timeout=60)


def test_the_scheduler_thread_killed_while_idle_goes_on(server):
    scheduler = server.runtime.synthesizer.scheduler
    thread = scheduler._thread

    async def scenario():
        async with VoiceClient.connect(server.ws_url) as c:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit))
            await say(c, "The first line after the fault.", 1)  # the request that wakes it meets the exception
            await say(c, "And the next one.", 2)
            return c

    c = asyncio.run(scenario())
    assert not c.of_type("error")  # nothing was in hand when it was hit: every request was served
    assert thread.is_alive() and faults(server) == 1


def test_a_render_raising_systemexit_ends_that_reply_with_an_error_and_the_next_turn_is_spoken(server):
    scheduler = server.runtime.synthesizer.scheduler
    real_render = scheduler.renders.render
    fired = []

    def render_once_exits(chunks):
        if not fired:
            fired.append(True)
            raise SystemExit("a library called exit()")
        return real_render(chunks)

    scheduler.renders.render = render_once_exits  # the thread reads it at its next render

    async def scenario():
        async with VoiceClient.connect(server.ws_url) as c:
            await c.send({"type": "say", "text": "This reply meets the fault."})
            error = await c.wait_for("error", timeout=60)
            end = await say(c, "And this one is spoken.", 1)
            return c, error, end

    try:
        c, error, end = asyncio.run(scenario())
    finally:
        scheduler.renders.render = real_render
    assert error["code"] == "engine_error" and error["engine"] == "tts" and "SystemExit" in error["message"]
    assert len(c.reply_frames(end["reply_id"])) == end["frames"] > 0 and end["reply_id"] != error["reply_id"]
    assert faults(server) == 1 and server.get("/healthz").status_code == 200
