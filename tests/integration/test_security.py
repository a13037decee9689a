"""Safe defaults (issue 12, items 3 and 4): no open server on a network by accident, no cross-site
WebSocket, no token in the logs, no idle socket holding a place, /funasr counted in max_sessions."""

from __future__ import annotations

import asyncio
import json
import logging
import select
import socket
import struct
import time

import httpx
import pytest
import websockets

from tests.conftest import make_settings, running_server
from voicebot import auth
from voicebot.config import ConfigError
from voicebot.config.server import ServerConfig
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

    def full_when(full: bool) -> None:
        """Until /readyz says the server is (not) at its limit: the module's earlier sessions gone
        first, then both /funasr connections counted (bounded: 10 s, or the test fails here)."""
        deadline = time.monotonic() + 10
        while (body := guarded_server.get("/readyz").json())["full"] is not full or (not full and body["active_sessions"]):
            assert time.monotonic() < deadline, f"/readyz never said full={full}: {body}"
            time.sleep(0.05)

    full_when(False)

    async def scenario() -> tuple[dict, int]:
        async with websockets.connect(base + "/funasr"), websockets.connect(base + "/funasr"):
            await asyncio.to_thread(full_when, True)
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


# ---- the HTTP routes (issue 29): places given back, bodies bounded, Host and token checked --------

def _speech(server, body: bytes, **headers) -> httpx.Response:
    return httpx.post(f"{server.http_url}/v1/audio/speech", content=body, timeout=30,
                      headers={"content-type": "application/json", **headers})


def _wait_for_no_audio_requests(server) -> float:
    deadline = time.monotonic() + 10
    while (active := server.metric("voicebot_audio_api_active")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return active


def _raw(port: int, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head)
    return sock


@pytest.mark.parametrize("body", [
    b"[" * 100_000,  # RecursionError in the JSON parser
    b'{"model": "m", "voice": "en", "input": "x", "speed": ' + b"9" * 5000 + b"}",  # past Python's 4300 digits
    b'{"model": "m", "voice": "en", "input": "\\ud800"}',  # a lone surrogate: was a 500 with a traceback
    b"\xff\xfe not UTF-8",
])
def test_a_speech_body_that_cannot_be_parsed_is_a_400_and_gives_its_place_back(guarded_server, body):
    """Such bodies raised something other than the route's own error, which kept the request's
    max_sessions place for ever: twenty of them locked everyone out until a restart."""
    for _ in range(guarded_server.settings.server.max_sessions + 1):
        refused = _speech(guarded_server, body)
        assert refused.status_code == 400 and refused.json()["error"]["message"]
    assert _wait_for_no_audio_requests(guarded_server) == 0
    ok = _speech(guarded_server, json.dumps({"model": "m", "voice": "en", "input": "hello", "response_format": "pcm"}).encode())
    assert ok.status_code == 200 and ok.content


def test_a_client_that_hangs_up_mid_body_gives_its_place_back(guarded_server):
    port = guarded_server.settings.server.port
    for _ in range(guarded_server.settings.server.max_sessions + 1):
        sock = _raw(port, b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.2)  # admitted, reading the body
        sock.close()
    assert _wait_for_no_audio_requests(guarded_server) == 0
    assert _speech(guarded_server, json.dumps({"model": "m", "voice": "en", "input": "hi", "response_format": "pcm"}).encode()).status_code == 200


def _stream_until_answered(port: int, head: bytes, chunk: bytes, most: int) -> tuple[int, bytes]:
    """Send `head`, then `chunk` in HTTP chunked encoding until the server answers (or `most`
    bytes are sent): the bytes sent, and the start of the answer."""
    sock = _raw(port, head)
    sent = 0
    try:
        while sent < most:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        sock.settimeout(30)
        return sent, sock.recv(200)
    finally:
        sock.close()


def test_a_speech_body_is_read_only_up_to_its_limit(guarded_server):
    """A 200 MB POST grew the server by 600 MB; now it stops at MAX_SPEECH_BODY_BYTES."""
    from voicebot.frontends.openai_audio.speech import MAX_SPEECH_BODY_BYTES

    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    sent, answer = _stream_until_answered(guarded_server.settings.server.port, head, b" " * 2**16, 200 * 2**20)
    assert answer.startswith(b"HTTP/1.1 413")
    assert sent < 64 * 2**20  # the server stopped reading at its limit (kernel buffers hold a few MiB more)
    assert MAX_SPEECH_BODY_BYTES < sent
    assert _wait_for_no_audio_requests(guarded_server) == 0


def test_a_chunked_upload_is_refused_at_the_limit_not_after_it_is_all_on_disk(guarded_server):
    from voicebot.frontends.openai_audio.transcriptions import MAX_UPLOAD_BYTES

    head = (b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: multipart/form-data; boundary=b0undary\r\n\r\n")
    port = guarded_server.settings.server.port
    part = (b"--b0undary\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n"
            b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n")
    sent, answer = _stream_until_answered(port, head + b"%x\r\n" % len(part) + part + b"\r\n", b"\0" * 2**18,
                                          4 * MAX_UPLOAD_BYTES)
    assert answer.startswith(b"HTTP/1.1 413")
    assert sent < 2 * MAX_UPLOAD_BYTES  # before: all 100 MiB went to a temporary file, then 413
    assert _wait_for_no_audio_requests(guarded_server) == 0


def _wav_header(rate: int, channels: int, data_bytes: int) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
    return (b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", data_bytes))


@pytest.mark.parametrize("wav, status, says", [
    (_wav_header(1, 1, 6000) + b"\1\0" * 3000, 400, "sample rate is 1 Hz"),  # was 667 MB and 16 s of CPU
    (_wav_header(16000, 200, 6400) + b"\0" * 6400, 400, "200 channels"),
])
def test_a_file_whose_header_is_out_of_bounds_is_refused_before_decoding(guarded_server, wav, status, says):
    refused = httpx.post(f"{guarded_server.http_url}/v1/audio/transcriptions", timeout=30,
                         files={"file": ("a.wav", wav)}, data={"model": "whisper-1"})
    assert refused.status_code == status and says in refused.json()["error"]["message"]
    assert _wait_for_no_audio_requests(guarded_server) == 0


@pytest.fixture(scope="module")
def token_server():
    with running_server(make_settings(server={"metrics_token": METRICS_TOKEN, "record_input_s": 1.0,
                                              "allowed_hosts": ["show.example.com"]})) as server:
        # Set after running_server's warm-up, which connects without a token; the app reads the
        # setting on every request.
        server.settings.server.token = TOKEN
        yield server


TOKEN, METRICS_TOKEN = "the-show-token", "the-scrape-token"


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/redoc", "/debug/input/nobody.wav"])
def test_every_http_route_but_the_public_ones_needs_the_token(token_server, path):
    url = token_server.http_url + path
    refused = httpx.get(url, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, timeout=10, params={"token": "wrong-token"}).status_code == 401
    allowed = httpx.get(url, timeout=10, headers={"Authorization": f"Bearer {TOKEN}"})
    assert allowed.status_code == (404 if path.startswith("/debug") else 200)
    scraper = httpx.get(url, timeout=10, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert scraper.status_code == (200 if path == "/metrics" else 401)  # the scrape token opens /metrics only


def test_the_public_routes_answer_without_the_token_and_readyz_says_only_ready(token_server):
    for path in ("/healthz", "/", "/v1/voices", "/static/mic-page.js"):
        assert httpx.get(token_server.http_url + path, timeout=10).status_code == 200, path
    public = httpx.get(token_server.http_url + "/readyz", timeout=10).json()
    assert public == {"ready": True, "draining": False, "full": False}
    assert "engines" in httpx.get(token_server.http_url + "/readyz", params={"token": TOKEN}, timeout=10).json()


def _upgrade(port: int, host: str, origin: str) -> bytes:
    sock = _raw(port, f"GET /v1/voice?token={TOKEN} HTTP/1.1\r\nHost: {host}\r\nOrigin: {origin}\r\nUpgrade: websocket\r\n"
                      "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                      "Sec-WebSocket-Version: 13\r\n\r\n".encode())
    try:
        return sock.recv(100).split(b"\r\n")[0]
    finally:
        sock.close()


def test_dns_rebinding_is_refused_by_the_host_allowlist(token_server):
    """A page on evil.example, its name made to resolve to 127.0.0.1, sent Origin and Host both
    evil.example: same-origin, so the Origin check let it drive the server."""
    port = token_server.settings.server.port
    assert _upgrade(port, f"evil.example:{port}", f"http://evil.example:{port}") == b"HTTP/1.1 403 Forbidden"
    speech = httpx.post(f"{token_server.http_url}/v1/audio/speech", headers={"Host": "evil.example", "Authorization": f"Bearer {TOKEN}"},
                        json={"model": "m", "voice": "en", "input": "hi"}, timeout=30)
    assert speech.status_code == 403 and speech.json()["error"]["code"] == "host_not_allowed"
    # The server's own names, and the operator's
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"show.example.com:{port}"):
        assert _upgrade(port, host, f"http://{host}") == b"HTTP/1.1 101 Switching Protocols", host
    assert httpx.get(f"{token_server.http_url}/healthz", headers={"Host": "voicebot"}, timeout=10).status_code == 200


@pytest.mark.parametrize("host, allowed, ok", [
    ("127.0.0.1:8000", [], True), ("[::1]:8000", [], True), ("localhost", [], True), ("app.localhost:1", [], True),
    ("evil.example", [], False), ("evil.example:8000", ["show.example.com"], False),
    ("Show.Example.com.:443", ["show.example.com"], True), ("a.example.com", ["*.example.com"], True),
    ("example.com", ["*.example.com"], False), ("anything", ["*"], True), (None, [], True), ("bad host:x:y", [], False),
])
def test_host_allowlist(host, allowed, ok):
    assert auth.host_allowed(host, allowed) is ok


def test_a_percent_encoded_token_parameter_is_hidden_in_the_logs_too():
    """`?tok%65n=` is read as `token` by the server, and was logged verbatim."""
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/metrics?tok%65n=s3cret-token&x=1&TOKEN=s3cret2", "1.1", 200), None)
    auth._HideTokens().filter(record)
    assert "s3cret" not in record.getMessage() and "x=1" in record.getMessage()


def test_a_keep_alive_connections_next_request_head_has_the_deadline_too():
    """After a first request, the second head could come a byte at a time for over 40 s. uvicorn
    with run_server.py's protocol class (voicebot/frontends/handshake.py) and a deadline of 1 s, on an app
    that answers 200: the protocol is what is tested, not the engines."""
    import threading

    import uvicorn

    from tests.conftest import bound_port
    from voicebot.frontends.handshake import with_deadline

    async def ok(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    server = uvicorn.Server(uvicorn.Config(ok, host="127.0.0.1", port=0, http=with_deadline(1.0), lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        sock = _raw(bound_port(server), b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(1000).startswith(b"HTTP/1.1 200")
        closed = False
        for byte in b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"x" * 100:  # 0.2 s a byte: 25 s
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if select.select([sock], [], [], 0.2)[0] and sock.recv(100) == b"":
                closed = True
                break
        assert closed  # well before the 25 s the head would take (the deadline is 1 s)
        sock.close()
    finally:
        server.should_exit = True
        thread.join(30)
