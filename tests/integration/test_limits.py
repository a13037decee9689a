"""Limits on every route (issue 12) and FunASR's token allow-list (issue 14, item 6).

Per-client-address connections and sessions, the client address behind a trusted proxy, the idle
timeout after session.start, the flood guard and idle timeout on /funasr, and /funasr without a
token from configured networks, through funasr-client. The servers here run with uvicorn's own
X-Forwarded-For handling off, as run_server.py runs them: the app alone decides whom to trust.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import numpy as np
import pytest
import soundfile
import websockets

from tests.asr.server import serve
from tests.audio import to_pcm16
from tests.conftest import VoiceClient, make_settings, speech_pcm
from voicebot.guards import flood
from voicebot.guards.flood import FloodGuard
from voicebot.guards.idle import IdleWatch
from voicebot.protocol import CloseCode, ErrorCode

TOKEN = "limits-secret"


@contextlib.contextmanager
def server(**sections):
    """The real app on 127.0.0.1; yields its base URL (ws://127.0.0.1:PORT)."""
    with serve(make_settings(**sections), proxy_headers=False) as port:
        yield f"ws://127.0.0.1:{port}"


def forwarded(address: str) -> dict:
    return {"additional_headers": {"X-Forwarded-For": address}}


async def first_event_and_close(url: str, **connect) -> tuple[dict, int | None]:
    """The first message (parsed) and the close code, for a connection the server ends."""
    async with websockets.connect(url, open_timeout=10, **connect) as ws:
        event = json.loads(await asyncio.wait_for(ws.recv(), 10))
        with contextlib.suppress(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
        return event, ws.close_code


@contextlib.asynccontextmanager
async def started(url: str, **connect):
    """A session that got session.ready."""
    async with websockets.connect(f"{url}/v1/voice", open_timeout=10, **connect) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "session.ready"
        yield ws


async def still_open(ws, seconds: float) -> bool:
    """Nothing arrives for `seconds` and the connection is still up."""
    with contextlib.suppress(asyncio.TimeoutError):
        while True:
            await asyncio.wait_for(ws.recv(), seconds)
    return ws.close_code is None


def refused_busy(event: dict, code: int | None) -> bool:
    return event["code"] == ErrorCode.BUSY and event["limit"] == "per_client" and code == CloseCode.TRY_AGAIN_LATER


# ---- per client address -------------------------------------------------------------------------


def test_sessions_per_client_address_behind_a_trusted_proxy():
    """Each address its own share; listeners are not sessions; /funasr is; a closed session frees its place."""
    async def scenario(url: str) -> None:
        a, b = forwarded("203.0.113.1"), forwarded("203.0.113.2")
        async with started(url, **a), started(url, **a):
            assert refused_busy(*await first_event_and_close(f"{url}/v1/voice", **a))
            assert refused_busy(*await first_event_and_close(f"{url}/funasr", **a))
            async with started(url, **b):
                pass
            async with websockets.connect(f"{url}/v1/voice?role=listener&channel=main", **a) as listener:
                assert json.loads(await asyncio.wait_for(listener.recv(), 10))["type"] == "listener.ready"
        await asyncio.sleep(0.3)  # the server sees both closes
        async with started(url, **a):
            pass

    with server(server={"max_sessions_per_client": 2, "trusted_proxies": ["127.0.0.1"]}) as url:
        asyncio.run(scenario(url))


def test_an_untrusted_peer_is_its_own_address_whatever_it_forwards():
    """Loopback is not exempt, and X-Forwarded-For from a peer not in trusted_proxies changes nothing."""
    async def scenario(url: str) -> tuple[dict, int | None]:
        async with started(url, **forwarded("203.0.113.1")):
            return await first_event_and_close(f"{url}/v1/voice", **forwarded("203.0.113.2"))

    with server(server={"max_sessions_per_client": 1, "trusted_proxies": ["192.0.2.1"]}) as url:
        event, code = asyncio.run(scenario(url))
    assert refused_busy(event, code) and "127.0.0.1" in event["message"]


def test_connections_per_client_address_count_every_route():
    async def scenario(url: str) -> tuple[dict, int | None]:
        listen = f"{url}/v1/voice?role=listener&channel=main"
        async with websockets.connect(listen), websockets.connect(listen):
            return await first_event_and_close(f"{url}/funasr")

    with server(server={"max_connections_per_client": 2}) as url:
        assert refused_busy(*asyncio.run(scenario(url)))


def test_audio_api_requests_are_sessions_of_their_client_address():
    """A request holds its address's session place from admission to its end (here an upload still
    arriving): another request from that address gets 429 in OpenAI's error shape, and a WebSocket
    session `busy`; other addresses are served, and the place is free again once the request ends."""
    speech = {"model": "tts-1", "voice": "en", "input": "Hello.", "response_format": "pcm"}
    boundary = "limitsboundary"
    upload_head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n"
                   f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
                   "Content-Type: audio/wav\r\n\r\n")

    async def scenario(url: str):
        http = url.replace("ws://", "http://")
        a, b = {"X-Forwarded-For": "203.0.113.1"}, {"X-Forwarded-For": "203.0.113.2"}
        rest_may_come = asyncio.Event()

        async def slow_body():
            yield upload_head.encode()
            await rest_may_come.wait()
            yield f"\r\n--{boundary}--\r\n".encode()

        async with httpx.AsyncClient(base_url=http, timeout=30) as client:
            held = asyncio.create_task(client.post(
                "/v1/audio/transcriptions", content=slow_body(),
                headers={**a, "Content-Type": f"multipart/form-data; boundary={boundary}"}))
            for _ in range(100):  # until the server has admitted it (at most 10 s)
                if "voicebot_audio_api_active 1.0" in (await client.get("/metrics")).text:
                    break
                await asyncio.sleep(0.1)
            ws_refusal = await first_event_and_close(f"{url}/v1/voice", additional_headers=a)
            again = await client.post("/v1/audio/speech", json=speech, headers=a)
            upload = await client.post("/v1/audio/transcriptions", headers=a, data={"model": "m"},
                                       files={"file": ("a.wav", b"RIFF", "audio/wav")})
            other = await client.post("/v1/audio/speech", json=speech, headers=b)
            rest_may_come.set()
            await held
            after = await client.post("/v1/audio/speech", json=speech, headers=a)
            counted = await client.get("/metrics")
        return again, upload, ws_refusal, other, after, counted.text

    with server(server={"max_sessions_per_client": 1, "trusted_proxies": ["127.0.0.1"]}) as url:
        again, upload, ws_refusal, other, after, metrics = asyncio.run(scenario(url))
    assert refused_busy(*ws_refusal)
    for refused in (again, upload):
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "5"
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        assert "203.0.113.1" in error["message"]
    assert other.status_code == 200 and after.status_code == 200  # the request's end gave its place back
    assert 'voicebot_audio_api_requests_total{outcome="rate_limit_exceeded",route="speech"} 1.0' in metrics
    assert 'voicebot_audio_api_requests_total{outcome="rate_limit_exceeded",route="transcriptions"} 1.0' in metrics


# ---- idle timeout -------------------------------------------------------------------------------


def test_a_session_that_sends_nothing_is_closed_one_that_streams_or_listens_is_not():
    async def scenario(url: str):
        async with websockets.connect(f"{url}/v1/voice?role=listener&channel=main") as listener:
            await asyncio.wait_for(listener.recv(), 10)
            async with started(url) as quiet, started(url) as streaming:
                for _ in range(25):  # 2.5 s of silence, in real time: audio flowing, not idle
                    await streaming.send(bytes(3200))
                    await asyncio.sleep(0.1)
                await streaming.send(json.dumps({"type": "ping", "id": 1}))
                pong = json.loads(await asyncio.wait_for(streaming.recv(), 10))
                with contextlib.suppress(websockets.ConnectionClosed):
                    while (event := json.loads(await asyncio.wait_for(quiet.recv(), 10)))["type"] != "error":
                        pass
                await asyncio.sleep(0.1)
                return event, quiet.close_code, pong, listener.close_code is None

    with server(server={"idle_timeout_s": 1.0}) as url:
        event, code, pong, listener_open = asyncio.run(scenario(url))
    assert event["code"] == ErrorCode.IDLE_TIMEOUT and code == CloseCode.POLICY
    assert pong["type"] == "pong" and listener_open


def test_a_session_is_not_idle_while_the_bot_replies():
    """A reply far longer than the timeout plays to its end; the clock starts when it ends."""
    async def scenario(url: str):
        async with VoiceClient.connect(f"{url}/v1/voice") as client:
            await client.send({"type": "say", "text": "this reply lasts much longer than the idle timeout of one second, "
                               "so a session that only listens to it must stay open until it ends"})
            end = await client.wait_for("audio.end", timeout=60)
            error = await client.wait_for("error", timeout=10)
            return client, end, error

    with server(server={"idle_timeout_s": 1.0}) as url:
        client, end, error = asyncio.run(scenario(url))
    assert end["frames"] * 0.2 > 3  # seconds of reply audio, three times the timeout
    assert len(client.reply_frames(end["reply_id"])) == end["frames"]
    assert error["code"] == ErrorCode.IDLE_TIMEOUT and client.events.index(error) > client.events.index(end)


def test_idle_watch():
    async def scenario() -> tuple[str, float, float]:
        loop = asyncio.get_running_loop()
        started_at = loop.time()
        reason = await IdleWatch(0.2).expire()
        quiet_for = loop.time() - started_at
        busy_until = started_at + 0.6
        started_at = loop.time()
        await IdleWatch(0.2, busy=lambda: loop.time() < busy_until).expire()
        return reason, quiet_for, loop.time() - started_at

    reason, quiet_for, busy_for = asyncio.run(scenario())
    assert reason == "nothing received for 0.2 s" and quiet_for >= 0.2
    # The clock ran from the end of the busy time, as the watch last saw it (it looks every 0.05 s).
    assert busy_for >= (0.6 - quiet_for) + 0.2 - 0.05


# ---- the flood guard ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(flood, "time", fake)
    return fake


def test_flood_guard_takes_real_time_and_a_stall_but_not_more(clock):
    guard = FloodGuard(max_messages_per_s=200, max_audio_factor=4, window_s=2)
    second = 2 * 16000
    for _ in range(600):  # ten minutes at real time, in 1 s chunks
        clock.now += 1
        assert guard.check(second, 16000) is None
    clock.now += 2  # a 2 s network stall: the 3 s it held back come at once, and 5 s more may
    assert all(guard.check(second, 16000) is None for _ in range(3 + 5))  # window_s x factor = 8 s
    assert guard.check(second, 16000) == "audio faster than 4x real time"


def test_flood_guard_burst_allowance_and_message_rate(clock):
    guard = FloodGuard(max_messages_per_s=200, max_audio_factor=4, window_s=2, audio_burst_s=60)
    assert all(guard.check(16000, 16000) is None for _ in range(2 * 68))  # 68 s of audio at once
    assert guard.check(16000, 16000) == "audio faster than 4x real time"
    clock.now += 10
    assert all(guard.check(0, 16000) is None for _ in range(400))
    assert guard.check(0, 16000) == "more than 200 messages per second"


# ---- /funasr: flood guard, idle timeout, the token allow-list ------------------------------------


async def funasr_until_closed(url: str, audio: bytes, chunk_bytes: int) -> tuple[list[dict], int | None]:
    """A 2pass stream that sends `audio` as fast as it can; every result, and the close code."""
    results = []

    async def read(ws) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            while not results or not results[-1]["is_final"]:
                results.append(json.loads(await ws.recv()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ws.recv(), 1)  # the close, if the server ends the connection

    async with websockets.connect(url, open_timeout=10) as ws:
        reader = asyncio.create_task(read(ws))
        await ws.send(json.dumps({"mode": "2pass", "wav_name": "fast", "wav_format": "pcm", "audio_fs": 16000,
                                  "is_speaking": True}))
        with contextlib.suppress(websockets.ConnectionClosed):
            for start in range(0, len(audio), chunk_bytes):
                await ws.send(audio[start : start + chunk_bytes])
            await ws.send(json.dumps({"is_speaking": False}))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(reader), 30)
        reader.cancel()
    return results, ws.close_code


def metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url.replace("ws://", "http://") + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_funasr_flooding_gets_an_error_result_and_the_close():
    speech = speech_pcm("hello there how are you")
    limits = {"max_audio_realtime_factor": 2.0, "window_s": 1.0, "funasr_audio_burst_s": 0.0}
    with server(limits=limits) as url:
        results, code = asyncio.run(funasr_until_closed(f"{url}/funasr", speech * 4, 8000))
        flooded = metric(url, 'voicebot_errors_total{code="flooding"}')
        dropped = metric(url, 'voicebot_input_dropped_seconds_total{reason="flooding"}')
        heard = metric(url, "voicebot_input_audio_seconds_total")
    final = results[-1]
    assert final["is_final"] and final["mode"] == "2pass-offline" and final["wav_name"] == "fast"
    assert final["text"].startswith("ERROR. flooding") and "real time" in final["error"]
    assert code == CloseCode.FLOODING and flooded == 1
    # The window's 2 s were heard; the message past them and every one received after it is counted
    # as dropped, and nothing is counted twice.
    assert heard >= 2.0 and dropped >= 0.25
    assert heard + dropped <= len(speech * 4) / 32000 + 1e-6


def test_funasr_burst_allowance_takes_a_file_sent_whole():
    speech = speech_pcm("hello there how are you")
    limits = {"max_audio_realtime_factor": 2.0, "window_s": 1.0, "funasr_audio_burst_s": 10.0}
    with server(limits=limits) as url:
        results, code = asyncio.run(funasr_until_closed(f"{url}/funasr", speech, 8000))
    assert len(speech) / 32000 > 2  # more than the window's own allowance
    assert results[-1]["is_final"] and not any("error" in r for r in results) and code == CloseCode.NORMAL  # closed by us


def test_a_quiet_funasr_connection_is_closed():
    async def scenario(url: str) -> tuple[dict, int | None]:
        async with websockets.connect(f"{url}/funasr") as ws:
            await ws.send(json.dumps({"mode": "2pass", "wav_name": "quiet", "is_speaking": True}))
            result = json.loads(await asyncio.wait_for(ws.recv(), 10))
            with contextlib.suppress(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            return result, ws.close_code

    with server(server={"idle_timeout_s": 1.0}) as url:
        result, code = asyncio.run(scenario(url))
    assert result["is_final"] and result["wav_name"] == "quiet" and result["error"] == "nothing received for 1 s"
    assert code == CloseCode.POLICY


@pytest.fixture(scope="module")
def wav_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("limits") / "hello.wav"
    soundfile.write(path, np.frombuffer(speech_pcm("hello there how are you"), "<i2"), 16000)
    return path


def funasr_client_result(url: str, path) -> dict:
    from funasr_client import async_file_asr

    return asyncio.run(asyncio.wait_for(async_file_asr(path, url, mode="2pass"), 60))


def test_funasr_clients_from_allowed_networks_need_no_token(wav_file):
    """funasr-client with no token, on /funasr, / and any path; every other route still needs it."""
    with server(server={"token": TOKEN, "funasr_tokenless_networks": ["127.0.0.0/8"]}) as url:
        results = [funasr_client_result(f"{url}{path}", wav_file) for path in ("/funasr", "/", "/wss/")]
        voice = asyncio.run(first_event_and_close(f"{url}/v1/voice"))
        obs = asyncio.run(first_event_and_close(f"{url}/obs/audio"))
    assert all(r["is_final"] and "error" not in r for r in results)
    for event, code in (voice, obs):
        assert event["code"] == ErrorCode.UNAUTHORIZED and code == CloseCode.UNAUTHORIZED


def test_funasr_clients_from_other_networks_need_the_token(wav_file):
    from websockets.exceptions import ConnectionClosedError

    with server(server={"token": TOKEN, "funasr_tokenless_networks": ["192.0.2.0/24"]}) as url:
        with pytest.raises(ConnectionClosedError) as refused:
            funasr_client_result(f"{url}/funasr", wav_file)
        with_token = funasr_client_result(f"{url}/funasr?token={TOKEN}", wav_file)
    assert refused.value.rcvd.code == CloseCode.UNAUTHORIZED and with_token["is_final"]


def test_the_allow_list_reads_the_address_a_trusted_proxy_forwards():
    async def first_result(url: str, address: str) -> tuple[dict, int | None]:
        async with websockets.connect(url, **forwarded(address)) as ws:
            with contextlib.suppress(websockets.ConnectionClosed):  # refused: closed while we send
                await ws.send(json.dumps({"mode": "offline", "wav_name": "w", "is_speaking": True}))
                await ws.send(to_pcm16(np.zeros(1600, np.float32)))
                await ws.send(json.dumps({"is_speaking": False}))
            result = json.loads(await asyncio.wait_for(ws.recv(), 10))
            with contextlib.suppress(websockets.ConnectionClosed, asyncio.TimeoutError):
                await asyncio.wait_for(ws.recv(), 1)
            return result, ws.close_code

    settings = {"token": TOKEN, "funasr_tokenless_networks": ["192.0.2.0/24"], "trusted_proxies": ["127.0.0.1"]}
    with server(server=settings) as url:
        inside = asyncio.run(first_result(f"{url}/funasr", "192.0.2.5"))
        outside = asyncio.run(first_result(f"{url}/funasr", "198.51.100.1"))
    assert inside[0]["is_final"] and "error" not in inside[0] and inside[1] is None
    assert outside[0]["code"] == ErrorCode.UNAUTHORIZED and outside[1] == CloseCode.UNAUTHORIZED


def test_required_token_by_network_and_route():
    from types import SimpleNamespace

    from voicebot.auth import required_token
    from voicebot.config.server import ServerConfig

    server = ServerConfig(token=TOKEN, funasr_tokenless_networks=["10.0.0.0/8", "2001:db8::/32"])

    def ws(host: str | None):
        return SimpleNamespace(client=None if host is None else SimpleNamespace(host=host))

    for host in ("10.1.2.3", "::ffff:10.1.2.3", "2001:db8::7"):  # an IPv4 client of a dual-stack socket too
        assert required_token(server, ws(host), funasr=True) is None
        assert required_token(server, ws(host), funasr=False) == TOKEN
    for host in ("11.0.0.1", "2001:db9::1", "unknown", None):
        assert required_token(server, ws(host), funasr=True) == TOKEN
