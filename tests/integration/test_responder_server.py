"""The OpenAI-compatible responder through the real voice server, over a real WebSocket.

Speech (espeak-ng) goes in; pocketsphinx with a closed grammar recognizes it; the responder asks a
local chat-completions server (tests/reply/sse_server.py) and the reply is spoken. Each test
asserts what the session emits and that the conversation holds exactly what was spoken.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from tests.conftest import TEST_PHRASES, RunningServer, VoiceClient, make_settings, running_server, speech_pcm
from tests.reply.sse_server import Behaviour, SSEServer

FALLBACK = "Sorry, say that again?"
SPEECH = speech_pcm(TEST_PHRASES[0])


@pytest.fixture(scope="module")
def sse_module():
    server = SSEServer().start()
    yield server
    server.stop()


def responder_settings(sse: SSEServer, **extra):
    return make_settings(
        reset={"interval_s": 0.3},
        reply={
            "engine": "openai",
            "fallback_line": FALLBACK,
            "openai": {"base_url": sse.base_url, "model": "test", "first_token_timeout_s": 2.0,
                       "total_timeout_s": 20, "retries": 1, "retry_backoff_s": 0.01},
        },
        **extra,
    )


@contextlib.contextmanager
def voice_server(settings, sse: SSEServer):
    with running_server(settings) as server:
        # The warm-up utterance asked for a reply too: let it end before a test resets the server.
        if sse.requests:
            sse.stream_closed.wait(5)
        yield server


@pytest.fixture(scope="module")
def voice(sse_module):
    with voice_server(responder_settings(sse_module), sse_module) as server:
        yield server


@pytest.fixture
def sse(sse_module, voice):
    sse_module.reset()  # after the server's warm-up utterance
    return sse_module


def history(voice: RunningServer, client: VoiceClient) -> list[dict]:
    session_id = client.of_type("session.ready")[0]["session_id"]
    return voice.on_loop(lambda: voice.runtime.sessions[session_id].conversation.messages())


def heard(client: VoiceClient) -> list[str]:
    return [e["text"] for e in client.of_type("asr.final")]


def run(coro):
    return asyncio.run(coro)


def test_a_reply_is_streamed_spoken_and_remembered_across_a_reset(voice, sse):
    sse.reset(Behaviour(chunks=["Hi", " there", ", friend."]), Behaviour(chunks=["I am Mo."]))

    async def scenario():
        async with VoiceClient.connect(voice.ws_url) as c:
            await c.stream(SPEECH, speed=4)
            await c.wait_for("audio.end")
            resets = len(c.of_type("state.reset"))
            await c.wait_for("state.reset", count=resets + 1)  # clears engine state, not the conversation
            await c.stream(SPEECH, speed=4)
            end = await c.wait_for("audio.end", count=2)
            return c, end, history(voice, c)

    c, end, messages = run(scenario())
    ready = c.of_type("session.ready")[0]
    assert ready["responder"] == "openai" and ready["resumed"] is False
    assert [e["text"] for e in c.of_type("reply.delta")] == ["Hi", " there", ", friend.", "I am Mo."]
    assert [e["text"] for e in c.of_type("reply.done")] == ["Hi there, friend.", "I am Mo."]
    assert len(c.reply_frames(end["reply_id"])) == end["frames"] > 0
    assert not c.of_type("error")
    said = heard(c)
    assert messages == [
        {"role": "user", "content": said[0]},
        {"role": "assistant", "content": "Hi there, friend."},
        {"role": "user", "content": said[1]},
        {"role": "assistant", "content": "I am Mo."},
    ]
    assert sse.requests[1]["body"]["messages"] == messages[:3]
    assert voice.metric("voicebot_reply_first_text_seconds_count") >= 2
    assert voice.metric("voicebot_reply_total_seconds_count") >= 2


async def ask_and_expect_an_error(voice):
    """Ask one question; return the client, its first error event and the history afterwards."""
    async with VoiceClient.connect(voice.ws_url) as c:
        await c.stream(SPEECH, speed=4)
        error = await c.wait_for("error")
        await c.wait_for("audio.end")
        return c, error, history(voice, c)


@pytest.mark.parametrize(
    "behaviour, failure",
    [
        (Behaviour(first_delay_s=5), "first_token_timeout"),
        (Behaviour(status=500), "status"),
        (Behaviour(malformed_at=0), "malformed"),
    ],
    ids=["slow_first_token", "error_status", "malformed_chunk"],
)
def test_a_failing_endpoint_gives_an_error_and_the_fallback_line(voice, sse, behaviour, failure):
    sse.reset(default=behaviour)
    errors_before = voice.metric("voicebot_reply_errors_total", f'kind="{failure}"')

    c, error, messages = run(ask_and_expect_an_error(voice))
    assert error["code"] == "reply_failed" and error["failure"] == failure
    assert [e["text"] for e in c.of_type("reply.done")] == [FALLBACK]
    assert c.frames
    assert len(sse.requests) == 2  # one retry, before any text
    assert messages == [{"role": "user", "content": heard(c)[0]}, {"role": "assistant", "content": FALLBACK}]
    assert voice.metric("voicebot_reply_errors_total", f'kind="{failure}"') == errors_before + 1


def test_a_stream_dropped_mid_reply_keeps_what_was_said(voice, sse):
    sse.reset(default=Behaviour(chunks=["Once upon a time.", " There was", " a fox."], drop_after=2))

    c, error, messages = run(ask_and_expect_an_error(voice))
    assert error["code"] == "reply_failed" and error["failure"] == "dropped"
    assert [e["text"] for e in c.of_type("reply.done")] == ["Once upon a time. There was"]
    assert len(sse.requests) == 1  # no retry once words were spoken
    assert messages[-1] == {"role": "assistant", "content": "Once upon a time. There was"}


def test_barge_in_closes_the_stream_and_history_keeps_only_what_was_heard(voice, sse):
    words = [f" word{i}." if i % 8 == 7 else f" word{i}" for i in range(2000)]
    sse.reset(default=Behaviour(chunks=words, interval_s=0.01))

    async def scenario():
        async with VoiceClient.connect(voice.ws_url) as c:
            await c.stream(SPEECH, speed=4)
            await c.wait_for("audio.start")
            deadline = time.monotonic() + 30
            while len(c.frames) < 8 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            # Barge-in: speech while the bot speaks, at the pace of a person talking.
            await asyncio.gather(c.stream(speech_pcm(TEST_PHRASES[3], tail_s=0)), c.wait_for("audio.interrupted"))
            interrupted = c.of_type("audio.interrupted")[0]
            sent_then = sse.sent
            closed = await asyncio.to_thread(sse.stream_closed.wait, 5)
            return c, interrupted, sent_then, closed, history(voice, c)

    c, interrupted, sent_then, closed, messages = run(scenario())
    assert interrupted["reason"] == "barge_in"
    assert closed
    assert sse.sent - sent_then <= 5  # chunks the server sent after the client went away
    assert sse.sent < len(words) // 2
    said = interrupted["heard_text"]
    assert said and "".join(words).strip().startswith(said)
    assert messages[:2] == [{"role": "user", "content": heard(c)[0]}, {"role": "assistant", "content": said}]


def test_a_reconnecting_client_resumes_its_conversation(voice, sse):
    sse.reset(Behaviour(chunks=["Hello!", " I remember."]), Behaviour(chunks=["Yes."]))

    async def scenario():
        async with VoiceClient.connect(voice.ws_url) as c:
            await c.stream(SPEECH, speed=4)
            await c.wait_for("audio.end")
            first = c.of_type("session.ready")[0]
        async with VoiceClient.connect(voice.ws_url, resume="no-such-session") as c:
            unknown = c.of_type("session.ready")[0]
        async with VoiceClient.connect(voice.ws_url, resume=first["session_id"]) as c:
            by_id = c.of_type("session.ready")[0]  # the id is public (logs, metrics): it resumes nothing
        async with VoiceClient.connect(voice.ws_url, resume=first["resume_token"]) as c:
            second = c.of_type("session.ready")[0]
            await c.stream(SPEECH, speed=4)
            await c.wait_for("audio.end")
        return first, unknown, by_id, second

    first, unknown, by_id, second = run(scenario())
    assert unknown["resumed"] is False and by_id["resumed"] is False
    assert second["resumed"] is True and second["session_id"] != first["session_id"]
    messages = sse.requests[1]["body"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "Hello! I remember."


def test_say_bypasses_the_responder(voice, sse):
    async def scenario():
        async with VoiceClient.connect(voice.ws_url) as c:
            await c.send({"type": "say", "text": "Welcome to the show."})
            await c.wait_for("audio.end")
            return c

    c = run(scenario())
    assert [e["text"] for e in c.of_type("reply.done")] == ["Welcome to the show."]
    assert sse.requests == []


def test_blocklist_and_max_length_apply_to_what_is_spoken_and_remembered(sse_module):
    settings = responder_settings(sse_module)
    settings.reply.blocklist = ["heck"]
    settings.reply.blocklist_replacement = "beep"
    settings.reply.max_reply_chars = 24

    with voice_server(settings, sse_module) as voice:
        sse_module.reset(default=Behaviour(chunks=["What", " the", " heck", " is", " going", " on", " here", " today?"]))

        async def scenario():
            async with VoiceClient.connect(voice.ws_url) as c:
                await c.stream(SPEECH, speed=4)
                await c.wait_for("audio.end")
                return c, history(voice, c)

        c, messages = run(scenario())
    assert [e["text"] for e in c.of_type("reply.done")] == ["What the beep is going "]
    assert messages[-1] == {"role": "assistant", "content": "What the beep is going "}
