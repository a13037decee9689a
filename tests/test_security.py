"""Safe defaults (issue 12, items 3 and 4): no open server on a network by accident, no cross-site
WebSocket, no token in the logs, no idle socket holding a place, /funasr counted in max_sessions."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
import websockets

from tests.conftest import make_settings, running_server
from voicebot import auth
from voicebot.config import ConfigError, ServerConfig
from voicebot.protocol import CloseCode, ErrorCode


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "::", "show.example.com"])
def test_a_server_on_the_network_without_a_token_refuses_to_start(host):
    with pytest.raises(ConfigError, match="server.token"):
        auth.check_exposure(ServerConfig(host=host))


@pytest.mark.parametrize("server", [ServerConfig(host="127.0.0.1"), ServerConfig(host="::1"), ServerConfig(host="localhost"),
                                    ServerConfig(host="0.0.0.0", token="a-long-secret")])
def test_loopback_or_a_token_starts(server):
    auth.check_exposure(server)


def test_allow_anonymous_starts_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="voicebot.auth"):
        auth.check_exposure(ServerConfig(host="0.0.0.0", allow_anonymous=True))
    assert "open to anyone" in caplog.text


@pytest.mark.parametrize(
    "origin, host, allowed, ok",
    [
        (None, "127.0.0.1:8000", [], True),  # not a browser
        ("http://127.0.0.1:8000", "127.0.0.1:8000", [], True),  # the server's own pages
        ("https://evil.example", "127.0.0.1:8000", [], False),
        ("http://127.0.0.1:8001", "127.0.0.1:8000", [], False),
        ("https://show.example.com", "voice.internal:8000", ["https://show.example.com/"], True),
        ("https://evil.example", "voice.internal:8000", ["*"], True),
    ],
)
def test_origin_policy(origin, host, allowed, ok):
    assert auth.origin_allowed(origin, host, allowed) is ok


def test_tokens_never_reach_the_logs():
    # A handler on the loggers themselves: an in-process uvicorn started by an earlier test sets
    # them not to propagate, so the root logger (and pytest's caplog) would see nothing at all.
    class Lines(logging.Handler):
        lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    auth.hide_tokens_in_logs()
    seen = Lines()
    loggers = [logging.getLogger("uvicorn.error"), logging.getLogger("uvicorn.access")]
    for logger in loggers:
        logger.addHandler(seen)
        logger.setLevel(logging.INFO)
    try:
        loggers[0].info('%s - "WebSocket %s" [accepted]', "127.0.0.1:5", "/obs/audio?channel=main&token=s3cret-token")
        loggers[1].info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/static/obs.html?token=s3cret-token", "1.1", 200)
    finally:
        for logger in loggers:
            logger.removeHandler(seen)
    text = "\n".join(seen.lines)
    assert len(seen.lines) == 2 and "s3cret-token" not in text
    assert text.count("token=<hidden>") == 2 and "channel=main" in text


@pytest.fixture(scope="module")
def guarded_server():
    with running_server(make_settings(server={"max_sessions": 2, "start_timeout_s": 1.0})) as server:
        yield server


async def _first_event_and_close(url: str, **connect) -> tuple[dict | None, int | None]:
    async with websockets.connect(url, open_timeout=10, **connect) as ws:
        event = None
        try:
            event = json.loads(await asyncio.wait_for(ws.recv(), 10))
            await asyncio.wait_for(ws.recv(), 10)
        except websockets.ConnectionClosed:
            pass
        return event, ws.close_code


def test_a_page_from_another_site_cannot_connect(guarded_server):
    url = guarded_server.ws_url
    event, code = asyncio.run(_first_event_and_close(url, origin="https://evil.example"))
    assert event["code"] == ErrorCode.FORBIDDEN_ORIGIN and code == CloseCode.POLICY

    async def same_origin() -> str:
        async with websockets.connect(url, origin=guarded_server.http_url) as ws:
            await ws.send(json.dumps({"type": "session.start"}))
            return json.loads(await asyncio.wait_for(ws.recv(), 10))["type"]

    assert asyncio.run(same_origin()) == "session.ready"


def test_idle_sockets_are_closed_and_free_their_places(guarded_server):
    """Two sockets that never send session.start held both places for ever; now each is closed
    after server.start_timeout_s and the next client gets in."""
    async def scenario() -> tuple[list, str, float]:
        started = time.monotonic()
        idle = await asyncio.gather(*(_first_event_and_close(guarded_server.ws_url) for _ in range(2)))
        waited = time.monotonic() - started
        async with websockets.connect(guarded_server.ws_url) as ws:
            await ws.send(json.dumps({"type": "session.start"}))
            return idle, json.loads(await asyncio.wait_for(ws.recv(), 10))["type"], waited

    # The module's earlier tests' sessions may still be closing (a recognizer stream's close is a
    # request to its decoding process, queued behind others' on a loaded box): their places first.
    deadline = time.monotonic() + 10
    while guarded_server.on_loop(lambda: len(guarded_server.runtime.sessions)) and time.monotonic() < deadline:
        time.sleep(0.05)
    idle, next_client, waited = asyncio.run(scenario())
    assert all(event["code"] == ErrorCode.START_TIMEOUT and code == CloseCode.POLICY for event, code in idle)
    assert waited < 8
    assert next_client == "session.ready"


def test_funasr_connections_count_toward_max_sessions(guarded_server):
    base = guarded_server.ws_url.removesuffix("/v1/voice")

    async def scenario() -> tuple[dict, int]:
        async with websockets.connect(base + "/funasr"), websockets.connect(base + "/funasr"):
            await asyncio.sleep(0.3)
            return await _first_event_and_close(guarded_server.ws_url)

    event, code = asyncio.run(scenario())
    assert event["code"] == ErrorCode.BUSY and code == CloseCode.TRY_AGAIN_LATER


def test_listeners_never_learn_the_session_id_or_resume_token(guarded_server):
    """The id once resumed the speaker's conversation, and an overlay on stream showed it to anyone
    (item 2); now the secret resume token does, and neither reaches a listener."""
    async def scenario() -> tuple[dict, dict]:
        async with websockets.connect(guarded_server.ws_url + "?role=listener&channel=secret") as listener:
            await asyncio.wait_for(listener.recv(), 10)  # listener.ready
            async with websockets.connect(guarded_server.ws_url) as speaker:
                await speaker.send(json.dumps({"type": "session.start", "channel": "secret"}))
                own = json.loads(await asyncio.wait_for(speaker.recv(), 10))
                while (mirrored := json.loads(await asyncio.wait_for(listener.recv(), 10)))["type"] != "session.ready":
                    pass
                return own, mirrored

    own, mirrored = asyncio.run(scenario())
    assert own["session_id"] and own["resume_token"] and not {"session_id", "resume_token"} & mirrored.keys()
    assert {k: v for k, v in own.items() if k not in ("session_id", "resume_token")} == mirrored


def test_connections_that_never_finish_their_request_head_are_closed(tmp_path):
    """A raw TCP connection that sends nothing and a slowloris one were open after 160 s (item 3);
    through run_server.py both are closed after server.handshake_timeout_s, sessions are not."""
    import socket


    from tests.conftest import start_server_process

    proc, port = start_server_process(tmp_path, {"handshake_timeout_s": 1})
    try:
        silent = socket.create_connection(("127.0.0.1", port))
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /v1/voice HTTP/1.1\r\nHost: x\r\n")  # and never the rest

        async def session_outlives_the_deadline() -> str:
            async with websockets.connect(f"ws://127.0.0.1:{port}/v1/voice") as ws:
                await ws.send(json.dumps({"type": "session.start"}))
                await asyncio.wait_for(ws.recv(), 10)
                await asyncio.sleep(2)
                await ws.send(json.dumps({"type": "ping", "id": 1}))
                return json.loads(await asyncio.wait_for(ws.recv(), 10))["type"]

        assert asyncio.run(session_outlives_the_deadline()) == "pong"
        for sock in (silent, slow):
            sock.settimeout(5)
            assert sock.recv(100) == b""  # closed by the server (it was over 2 s ago)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_stranger_cannot_take_over_a_channel_but_the_speaker_resuming_can():
    """Any client could make itself a channel's speaker, so an overlay on stream played a stranger's
    `say` (item 2). While the speaker is connected, only its own client resuming takes the channel."""
    from tests.conftest import VoiceClient

    async def scenario(url: str):
        async with VoiceClient.connect(f"{url}?role=listener&channel=stage", send_start=False) as listener:
            await listener.wait_for("listener.ready")
            async with VoiceClient.connect(url, channel="stage") as owner:
                async with VoiceClient.connect(url, channel="stage") as stranger:
                    refused = await stranger.wait_for("error", code=ErrorCode.CHANNEL_TAKEN)
                    await stranger.send({"type": "say", "text": "a stranger on stream"})
                    await stranger.wait_for("audio.end")
                # The owner's client comes back before its old socket is seen closed.
                token = owner.of_type("session.ready")[0]["resume_token"]
                async with VoiceClient.connect(url, channel="stage", resume=token) as back:
                    assert not back.of_type("error")
                    await back.send({"type": "say", "text": "the host again"})
                    end = await back.wait_for("audio.end")
                    await listener.wait_for("reply.done", text="the host again")
            return refused, listener, end

    with running_server(make_settings()) as server:
        refused, listener, end = asyncio.run(scenario(server.ws_url))
    assert "stage" in refused["message"]
    assert [e["text"] for e in listener.of_type("reply.done")] == ["the host again"]
    assert len(listener.reply_frames(end["reply_id"])) == end["frames"]
