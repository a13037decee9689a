"""The OpenAI-compatible responder through the real voice server, over a real WebSocket.

Speech (espeak-ng) goes in; pocketsphinx with a closed grammar recognizes it; the responder asks a
local chat-completions server (tests/reply/sse_server.py) and the reply is spoken. Each test
asserts what the session emits and that the conversation holds exactly what was spoken.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from websockets.asyncio.client import connect

from tests.audio import espeak_speech, to_pcm16
from tests.reply.sse_server import Behaviour, SSEServer
from voicebot.app import create_app
from voicebot.config import load_settings

FALLBACK = "Sorry, say that again?"
PHRASES = ["hello there", "good night"]  # what the tests say is "hello there": recognized reliably
CHUNK = 1600 * 2  # 100 ms of 16 kHz s16le


class VoiceServer:
    """The real app under uvicorn in a thread, on 127.0.0.1 and a free port."""

    def __init__(self, settings) -> None:
        self.app = create_app(settings)
        self.runtime = self.app.state.runtime
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "the voice server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def sse_module():
    server = SSEServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def voice(sse_module):
    settings = load_settings(
        asr={"engine": "pocketsphinx", "pocketsphinx": {"phrases": PHRASES}},
        reset={"interval_s": 0.3},
        reply={
            "engine": "openai",
            "fallback_line": FALLBACK,
            "openai": {"base_url": sse_module.base_url, "model": "test", "first_token_timeout_s": 2.0,
                       "total_timeout_s": 20, "retries": 1, "retry_backoff_s": 0.01},
        },
    )
    server = VoiceServer(settings)
    yield server
    server.stop()


@pytest.fixture
def sse(sse_module):
    sse_module.reset()
    return sse_module


class Client:
    def __init__(self, ws) -> None:
        self.ws = ws
        self.events: list[dict] = []
        self.frames = 0

    async def start(self, **fields) -> dict:
        await self.ws.send(json.dumps({"type": "session.start", **fields}))
        return await self.until("session.ready")

    async def say_aloud(self, text: str, end: bool = True, real_time: bool = False) -> None:
        pcm = to_pcm16(espeak_speech(text))
        for i in range(0, len(pcm), CHUNK):
            await self.ws.send(pcm[i : i + CHUNK])
            if real_time:
                await asyncio.sleep(0.1)
        if end:
            await self.ws.send(json.dumps({"type": "input.end"}))

    async def until(self, *types: str, frames: int | None = None, timeout: float = 30) -> dict | None:
        """Read events (counting audio frames) until one of `types` arrives (returned), or until
        `frames` audio frames have arrived."""
        deadline = time.monotonic() + timeout
        while frames is None or self.frames < frames:
            message = await asyncio.wait_for(self.ws.recv(), deadline - time.monotonic())
            if isinstance(message, bytes):
                self.frames += 1
                continue
            event = json.loads(message)
            self.events.append(event)
            if event["type"] in types:
                return event
        return None

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


def session_of(voice: VoiceServer, ready: dict):
    return voice.runtime.sessions[ready["session_id"]]


def run(coro):
    return asyncio.run(coro)


def url(voice: VoiceServer) -> str:
    return f"ws://127.0.0.1:{voice.port}/v1/voice"


def test_a_reply_is_streamed_spoken_and_remembered_across_a_reset(voice, sse):
    sse.reset(Behaviour(chunks=["Hi", " there", ", friend."]), Behaviour(chunks=["I am Mo."]))

    async def scenario():
        async with connect(url(voice)) as ws:
            c = Client(ws)
            ready = await c.start()
            await c.say_aloud("hello there")
            end = await c.until("audio.end")
            await c.until("state.reset")  # the periodic reset clears engine state, not the conversation
            await c.say_aloud("hello there")
            await c.until("audio.end")
            return c, ready, end, session_of(voice, ready).conversation.messages()

    c, ready, end, history = run(scenario())
    heard = [e["text"] for e in c.of("asr.final")]
    assert ready["responder"] == "openai" and ready["resumed"] is False
    assert "".join(e["text"] for e in c.of("reply.delta")[:3]) == "Hi there, friend."
    assert [e["text"] for e in c.of("reply.done")] == ["Hi there, friend.", "I am Mo."]
    assert end["frames"] > 0 and c.frames >= end["frames"]
    assert not c.of("error")
    assert history == [
        {"role": "user", "content": heard[0]},
        {"role": "assistant", "content": "Hi there, friend."},
        {"role": "user", "content": heard[1]},
        {"role": "assistant", "content": "I am Mo."},
    ]
    assert sse.requests[1]["body"]["messages"] == history[:3]

    metrics = httpx.get(f"http://127.0.0.1:{voice.port}/metrics").text
    assert _sample(metrics, "voicebot_reply_first_text_seconds_count") >= 2
    assert _sample(metrics, "voicebot_reply_total_seconds_count") >= 2


@pytest.mark.parametrize(
    "behaviour, kind",
    [
        (Behaviour(first_delay_s=5), "first_token_timeout"),
        (Behaviour(status=500), "status"),
        (Behaviour(malformed_at=0), "malformed"),
    ],
    ids=["slow_first_token", "error_status", "malformed_chunk"],
)
def test_a_failing_endpoint_gives_an_error_and_the_fallback_line(voice, sse, behaviour, kind):
    sse.reset(default=behaviour)

    async def scenario():
        async with connect(url(voice)) as ws:
            c = Client(ws)
            ready = await c.start()
            await c.say_aloud("hello there")
            error = await c.until("error")
            await c.until("audio.end")
            return c, error, session_of(voice, ready).conversation.messages()

    c, error, history = run(scenario())
    assert error["code"] == "reply_failed" and error["failure"] == kind
    assert [e["text"] for e in c.of("reply.done")] == [FALLBACK]
    assert c.frames > 0
    assert len(sse.requests) == 2  # one retry, before any text
    assert history == [{"role": "user", "content": c.of("asr.final")[0]["text"]}, {"role": "assistant", "content": FALLBACK}]


def test_a_stream_dropped_mid_reply_keeps_what_was_said(voice, sse):
    sse.reset(default=Behaviour(chunks=["Once upon a time.", " There was", " a fox."], drop_after=2))

    async def scenario():
        async with connect(url(voice)) as ws:
            c = Client(ws)
            ready = await c.start()
            await c.say_aloud("hello there")
            error = await c.until("error")
            await c.until("audio.end")
            return c, error, session_of(voice, ready).conversation.messages()

    c, error, history = run(scenario())
    assert error["code"] == "reply_failed" and error["failure"] == "dropped"
    assert [e["text"] for e in c.of("reply.done")] == ["Once upon a time. There was"]
    assert len(sse.requests) == 1  # no retry once words were spoken
    assert history[-1] == {"role": "assistant", "content": "Once upon a time. There was"}


def test_barge_in_closes_the_stream_and_history_keeps_only_what_was_heard(voice, sse):
    words = [f" word{i}." if i % 8 == 7 else f" word{i}" for i in range(2000)]
    sse.reset(default=Behaviour(chunks=words, interval_s=0.01))

    async def scenario():
        async with connect(url(voice)) as ws:
            c = Client(ws)
            ready = await c.start()
            await c.say_aloud("hello there")
            await c.until(frames=8)
            # Barge-in: speech while the bot speaks, at the pace of a person talking.
            await asyncio.gather(c.say_aloud("hello there", end=False, real_time=True), c.until("audio.interrupted"))
            interrupted = c.of("audio.interrupted")[0]
            sent_then = sse.sent
            closed = await asyncio.to_thread(sse.stream_closed.wait, 5)
            return c, interrupted, sent_then, closed, session_of(voice, ready).conversation.messages()

    c, interrupted, sent_then, closed, history = run(scenario())
    assert interrupted["reason"] == "barge_in"
    assert closed
    assert sse.sent - sent_then <= 5  # chunks the server sent after the client went away
    assert sse.sent < len(words) // 2
    heard = interrupted["heard_text"]
    assert heard and "".join(words).strip().startswith(heard)
    assert history == [{"role": "user", "content": c.of("asr.final")[0]["text"]}, {"role": "assistant", "content": heard}]


def test_a_reconnecting_client_resumes_its_conversation(voice, sse):
    sse.reset(Behaviour(chunks=["Hello!", " I remember."]), Behaviour(chunks=["Yes."]))

    async def scenario():
        async with connect(url(voice)) as ws:
            c = Client(ws)
            first = await c.start()
            await c.say_aloud("hello there")
            await c.until("audio.end")
        async with connect(url(voice)) as ws:
            c = Client(ws)
            unknown = await c.start(resume="no-such-session")
        async with connect(url(voice)) as ws:
            c = Client(ws)
            second = await c.start(resume=first["session_id"])
            await c.say_aloud("hello there")
            await c.until("audio.end")
        return first, unknown, second

    first, unknown, second = run(scenario())
    assert unknown["resumed"] is False
    assert second["resumed"] is True and second["session_id"] != first["session_id"]
    messages = sse.requests[1]["body"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "Hello! I remember."


def test_say_bypasses_the_responder(voice, sse):
    async def scenario():
        async with connect(url(voice)) as ws:
            c = Client(ws)
            await c.start()
            await ws.send(json.dumps({"type": "say", "text": "Welcome to the show."}))
            await c.until("audio.end")
            return c

    c = run(scenario())
    assert [e["text"] for e in c.of("reply.done")] == ["Welcome to the show."]
    assert sse.requests == []


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
