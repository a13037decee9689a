"""A hypothesis fuzzer of the three WebSocket protocols (/v1/voice, /obs/audio, /funasr) and of the
HTTP routes (/v1/audio/speech, /v1/audio/transcriptions, the GET routes) against the real server on
127.0.0.1, and the socket limit of run_server.py.

Each example opens one connection, sends a short generated sequence (valid messages with fuzzed
fields, the hostile frames of tests/hostile.py, random JSON, text and bytes) as fast as it can,
then checks that the session is alive: /v1/voice answers a `ping` with its `pong`, /funasr answers
`is_speaking: false` with its final message. A connection the server closed must have been closed
with a documented code after an `error` event (flooding, busy). After the client leaves, the
server's handler must end without an exception ("Exception in ASGI application" is a session that
died), and the server must still serve /healthz. Bounded: about 2,500 messages in all, under a
minute on two cores (and a server start).

Each HTTP example is one request with a generated body (fuzzed fields, random bytes, hostile
JSON): the answer must be a success or a documented refusal with a message (never a 500, never a
dead handler), and the request must have given its max_sessions place back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import io
import logging
import struct
import time
import wave

import httpx
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_settings, running_server, start_server_process
from tests.hostile import HOSTILE_TEXT, obs_chunk
from voicebot import protocol

MAX_MESSAGES = 20  # per example
FUZZ = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
# Closes that follow an `error` event and are documented in docs/protocol.md.
DOCUMENTED_CLOSES = {protocol.CloseCode.FLOODING, protocol.CloseCode.TRY_AGAIN_LATER, protocol.CloseCode.POLICY}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
hostile_text = st.sampled_from(HOSTILE_TEXT)
random_text = st.text(max_size=40)
pcm_bytes = st.binary(max_size=3000) | st.integers(0, 100_000).map(bytes)  # noise, or silence of any length (odd, over 1 s)


def fuzzed_object(types: list[str], fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[str]:
    """A JSON object of one of `types`, with some of `fields` (valid values or anything)."""
    values = st.fixed_dictionaries({}, optional={k: v | json_values for k, v in fields.items()})
    return st.tuples(st.sampled_from(types), values).map(lambda tv: json.dumps({"type": tv[0], **tv[1]}))


voice_text = fuzzed_object(
    [*protocol.CLIENT_TYPES, "dance"],
    {
        "sample_rate": st.sampled_from([8000, 16000, 44100, 48000, 7999, 48001]),
        "voice": st.sampled_from(["en", "zh", "nope"]),
        "responder": st.sampled_from(["echo", "nope"]),
        "language": st.sampled_from(["en", "zh"]),
        "channel": st.sampled_from(["main", "fuzz", "bad name!"]),
        "resume": st.text(max_size=40),
        "endpointing": st.fixed_dictionaries({}, optional={"endpoint_silence_ms": st.integers(0, 9000), "barge_in_min_ms": st.integers(-1, 9000)}),
        "text": st.sampled_from(["hello there", "", "x" * 2001]) | st.text(max_size=30),
        "interrupt": st.booleans(),
        "id": st.integers() | st.text(max_size=10),
    },
)
voice_messages = st.lists(st.one_of(voice_text, voice_text, hostile_text, random_text, pcm_bytes, pcm_bytes), max_size=MAX_MESSAGES)
voice_start = st.sampled_from([{"type": "session.start"}, {"type": "session.start", "sample_rate": 8000}, None])

obs_header_field = st.sampled_from([0, 1, 2, 16, 8000, 48000, 192001, 2**32 - 1]) | st.integers(0, 2**32 - 1)
obs_binary = st.one_of(
    st.builds(lambda n, rate, channels: obs_chunk(bytes(n), rate=rate, channels=channels),
              st.integers(0, 20_000), st.sampled_from([16000, 44100, 48000]), st.sampled_from([1, 2, 6])),
    st.builds(lambda rate, channels, bits, pcm: obs_chunk(pcm, rate=rate, channels=channels, bits=bits),
              obs_header_field, obs_header_field, obs_header_field, st.binary(max_size=2000)),
    st.binary(max_size=100),
)
obs_text = fuzzed_object(["start", "stop", "dance"], {"timestamp": st.integers(0, 2**64)})
obs_messages = st.lists(st.one_of(obs_binary, obs_binary, obs_text, hostile_text, random_text), max_size=MAX_MESSAGES)

funasr_text = st.fixed_dictionaries({}, optional={
    "mode": st.sampled_from(["2pass", "online", "offline", "dance"]) | json_values,
    "chunk_size": st.just([5, 10, 5]) | json_values,
    "wav_name": st.text(max_size=20) | json_values,
    "wav_format": st.sampled_from(["pcm", "wav"]) | json_values,
    "audio_fs": st.sampled_from([8000, 16000, 48000, 100]) | json_values,
    "is_speaking": st.booleans() | json_values,
    "hotwords": st.text(max_size=30),
    "itn": st.booleans(),
}).map(json.dumps)
funasr_messages = st.lists(st.one_of(funasr_text, funasr_text, hostile_text, random_text, pcm_bytes, pcm_bytes), max_size=MAX_MESSAGES)


class HandlerCrashes(logging.Handler):
    """Counts uvicorn's "Exception in ASGI application": a connection whose handler died."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def fuzzed_server():
    crashes = HandlerCrashes()
    logging.getLogger("uvicorn.error").addHandler(crashes)
    try:
        with running_server(make_settings(reset={"interval_s": 2.0})) as server:
            server.crashes = crashes
            yield server
            assert server.get("/healthz").status_code == 200
            assert server.thread.is_alive()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(crashes)


def run_example(server, path: str, messages: list[str | bytes], liveness) -> None:
    before = len(server.crashes.records)
    events: list[dict] = []
    close_code = asyncio.run(_converse(f"ws://127.0.0.1:{server.settings.server.port}{path}", messages, liveness, events))
    if close_code is not None:  # the server closed the connection first
        assert close_code in DOCUMENTED_CLOSES, f"closed with {close_code} after {[e.get('type') for e in events]}"
        assert any(e.get("type") == "error" for e in events), f"closed with {close_code} and no error event"
    _wait_for_handlers(server)
    crashed = server.crashes.records[before:]
    assert not crashed, f"{path}: the handler died: {crashed[0].getMessage()} {crashed[0].exc_info and crashed[0].exc_info[1]!r}"


async def _converse(url: str, messages: list[str | bytes], liveness, events: list[dict]) -> int | None:
    """Send everything, then check liveness; the server's close code if it closed first, else None."""
    async with websockets.connect(url, max_size=None, open_timeout=10) as ws:
        received: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            with contextlib.suppress(websockets.ConnectionClosed):
                async for message in ws:
                    if isinstance(message, str):
                        event = json.loads(message)
                        events.append(event)
                        await received.put(event)

        async def wait_event(matches, what: str, timeout: float = 20) -> None:
            deadline = time.monotonic() + timeout
            while not reader.done() or not received.empty():
                get = asyncio.create_task(received.get())
                await asyncio.wait({get, reader}, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED)
                if get.done() and matches(get.result()):
                    return
                get.cancel()
                assert time.monotonic() < deadline, f"no {what} within {timeout} s: the session is not answering"
            raise websockets.ConnectionClosed(None, None)

        reader = asyncio.create_task(read())
        try:
            for message in messages:
                await ws.send(message)
            await liveness(ws, wait_event)
        except websockets.ConnectionClosed:
            await asyncio.wait_for(reader, 5)  # the events that came before the close
        finally:
            reader.cancel()
        server_close = ws.close_code  # we have not closed: a code here is the server's (1006: it vanished)
        ws.transport.abort()  # leave without the closing handshake: quicker, and a disconnect to survive too
    return server_close


async def voice_alive(ws, wait_event) -> None:
    await ws.send(json.dumps({"type": "ping", "id": "alive"}))
    await wait_event(lambda e: e.get("type") == "pong" and e.get("id") == "alive", "pong")


async def funasr_alive(ws, wait_event) -> None:
    await ws.send(json.dumps({"is_speaking": False}))
    await wait_event(lambda e: e.get("is_final") is True, "final message")


async def obs_alive(ws, _wait_event) -> None:
    """The plugin protocol answers nothing: give the server time to read what was sent (each
    message takes it milliseconds), then see that the connection is still open."""
    await asyncio.sleep(0.3)
    await asyncio.wait_for(await ws.ping(), 10)


def _wait_for_handlers(server, timeout: float = 20) -> None:
    """Until every WebSocket handler on the server has returned (and uvicorn logged any crash)."""
    def handlers() -> int:
        return sum(1 for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith("run_asgi") and not t.done())

    deadline = time.monotonic() + timeout
    while server.on_loop(handlers):
        assert time.monotonic() < deadline, "a WebSocket handler did not end after its client left"
        time.sleep(0.01)


@FUZZ
@given(start=voice_start, messages=voice_messages)
def test_fuzz_voice(fuzzed_server, start, messages):
    run_example(fuzzed_server, "/v1/voice", ([json.dumps(start)] if start else []) + messages, voice_alive)


@settings(FUZZ, max_examples=60)
@given(messages=obs_messages)
def test_fuzz_obs_audio(fuzzed_server, messages):
    run_example(fuzzed_server, "/obs/audio?channel=fuzz", messages, obs_alive)


@settings(FUZZ, max_examples=60)
@given(messages=funasr_messages)
def test_fuzz_funasr(fuzzed_server, messages):
    run_example(fuzzed_server, "/funasr", messages, funasr_alive)


@pytest.mark.parametrize("raw", HOSTILE_TEXT)
@pytest.mark.parametrize("path, liveness", [("/v1/voice", voice_alive), ("/obs/audio?channel=fuzz", obs_alive), ("/funasr", funasr_alive)],
                         ids=["voice", "obs", "funasr"])
def test_hostile_frames_on_every_route(fuzzed_server, path, liveness, raw):
    """The reproductions of issue 12, item 6, each on its own."""
    run_example(fuzzed_server, path, [raw], liveness)


# ---- the socket limit, through run_server.py --------------------------------------------------


@pytest.fixture(scope="module")
def run_server_process(tmp_path_factory):
    process, port = start_server_process(tmp_path_factory.mktemp("limits"), {})
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


def test_the_largest_valid_obs_chunk_is_accepted_and_an_oversize_message_closes_1009(run_server_process):
    largest = obs_chunk(bytes(192000 * 8 * 2), rate=192000, channels=8, source_id=b"i" * 1024, source_name=b"n" * 1024)
    assert len(largest) == 3_074_076  # docs/protocol.md, Limits

    async def scenario() -> tuple[bool, int | None]:
        async with websockets.connect(run_server_process + "/obs/audio?channel=limits", max_size=None) as ws:
            await ws.send(largest)
            await asyncio.wait_for(await ws.ping(), 10)  # still open
            accepted = ws.close_code is None
        async with websockets.connect(run_server_process + "/v1/voice", max_size=None) as ws:
            # Only the frame's header, which declares one byte over the limit, and a few bytes of it:
            # the server refuses it on the header. Sent whole, the rest of the 4 MB still in flight
            # when the server closes makes its kernel answer with a reset, and the 1009 may be lost.
            size = protocol.MAX_MESSAGE_BYTES + 1
            ws.transport.write(bytes([0x82, 0x80 | 127]) + size.to_bytes(8, "big") + bytes(4) + bytes(16))
            with contextlib.suppress(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
                await asyncio.wait_for(ws.recv(), 10)
            return accepted, ws.close_code

    accepted, close_code = asyncio.run(scenario())
    assert accepted
    assert close_code == protocol.CloseCode.TOO_BIG


# ---- the HTTP routes ------------------------------------------------------------------------------

HTTP_REFUSALS = {400, 401, 403, 404, 405, 413, 422}  # documented refusals, each with a message
hostile_json = st.sampled_from([b"[" * 100_000, b"{" * 50_000, b'{"a": ' + b"9" * 5000 + b"}", b'"\\ud800"',
                                b'{"input": "\\udfff"}', b"\xff\xfe\x00", b"", b"null", b"1e999999", b"-" * 10])
speech_body = st.one_of(
    # a valid request with some of its fields replaced or added
    st.fixed_dictionaries({}, optional={
        "model": json_values, "voice": st.sampled_from(["en", "nope", ""]) | json_values,
        "input": st.sampled_from(["hello there", "", " ", "\ud800", "x" * 4097]) | st.text(max_size=30) | json_values,
        "response_format": st.sampled_from(["mp3", "opus", "aac", "flac", "wav", "pcm", "ogg"]) | json_values,
        "stream_format": st.sampled_from(["audio", "sse", "x"]) | json_values,
        "speed": st.sampled_from([1, 1.0, 0.25, 4.5, True]) | json_values,
        "instructions": json_values,
    }).map(lambda fields: json.dumps({"model": "tts-1", "voice": "en", "input": "hello"} | fields).encode()),
    json_values.map(lambda value: json.dumps(value).encode()),
    hostile_json,
    st.binary(max_size=200),
)


def _wav(rate: int, channels: int, bits: int, frames: bytes) -> bytes:
    """A WAV whose header says what it is told, whatever the data."""
    fmt = struct.pack("<HHIIHH", 1, channels, rate, (rate * channels * bits // 8) % 2**32, (channels * bits // 8) % 2**16, bits)
    return b"RIFF" + struct.pack("<I", 36 + len(frames)) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + \
        b"data" + struct.pack("<I", len(frames)) + frames


def _real_wav(seconds: float) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(bytes(int(32000 * seconds)))
    return buffer.getvalue()


upload_file = st.one_of(
    st.builds(_wav, st.sampled_from([0, 1, 7999, 8000, 16000, 384001, 2**32 - 1]), st.sampled_from([0, 1, 2, 33, 2**16 - 1]),
              st.sampled_from([8, 16, 24, 32, 0, 7]), st.binary(max_size=4000)),
    st.floats(0, 2).map(_real_wav),
    st.binary(max_size=3000),
    st.sampled_from([b"#EXTM3U\nfile:///etc/passwd\n", b"ffconcat version 1.0\nfile '/etc/passwd'\n", b"ID3" + bytes(200)]),
)
upload_fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["", "whisper-1"]) | st.text(max_size=10),
    "response_format": st.sampled_from(["json", "text", "srt", "vtt", "verbose_json", "diarized_json", ""]),
    "language": st.sampled_from(["en", "", "xx"]) | st.text(max_size=5),
    "stream": st.sampled_from(["true", "false", "x"]),
    "timestamp_granularities[]": st.sampled_from(["segment", "word"]),
}).map(lambda fields: {"model": "whisper-1"} | fields)


def _check_http(server, response: httpx.Response, before: int) -> None:
    assert response.status_code == 200 or response.status_code in HTTP_REFUSALS, f"{response.status_code}: {response.text[:300]}"
    if response.status_code != 200:
        assert response.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while server.metric("voicebot_audio_api_active") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.metric("voicebot_audio_api_active") == 0, "a request kept its max_sessions place"
    crashed = server.crashes.records[before:]
    assert not crashed, f"the handler died: {crashed[0].getMessage()} {crashed[0].exc_info and crashed[0].exc_info[1]!r}"


@settings(FUZZ, max_examples=40)
@given(body=speech_body, content_type=st.sampled_from(["application/json", "text/plain", "multipart/form-data"]))
def test_fuzz_speech(fuzzed_server, body, content_type):
    before = len(fuzzed_server.crashes.records)
    response = httpx.post(f"{fuzzed_server.http_url}/v1/audio/speech", content=body, timeout=60,
                          headers={"content-type": content_type})
    _check_http(fuzzed_server, response, before)


@settings(FUZZ, max_examples=30)
@given(file=upload_file, name=st.sampled_from(["a.wav", "a.mp3", "a.m4a", "noname", "../../etc/passwd"]), fields=upload_fields)
def test_fuzz_transcriptions(fuzzed_server, file, name, fields):
    before = len(fuzzed_server.crashes.records)
    response = httpx.post(f"{fuzzed_server.http_url}/v1/audio/transcriptions", timeout=60, data=fields,
                          files={"file": (name, file)})
    _check_http(fuzzed_server, response, before)


@settings(FUZZ, max_examples=30)
@given(path=st.sampled_from(["/healthz", "/readyz", "/metrics", "/v1/voices", "/docs", "/openapi.json", "/nope",
                             "/v1/audio/speech", "/debug/input/x.wav"]),
       query=st.dictionaries(st.sampled_from(["token", "tok%65n", "x", "channel"]), st.text(max_size=10), max_size=3),
       host=st.sampled_from(["127.0.0.1", "localhost", "evil.example", "[::1]", "a b", ""]))
def test_fuzz_get_routes(fuzzed_server, path, query, host):
    before = len(fuzzed_server.crashes.records)
    response = httpx.get(f"{fuzzed_server.http_url}{path}", params=query, headers={"Host": host}, timeout=30)
    assert response.status_code < 500 or (path == "/readyz" and response.status_code == 503), response.text[:300]
    if host in ("evil.example", "a b") and path not in ("/healthz", "/readyz"):
        assert response.status_code in (400, 403)
    _check_http(fuzzed_server, httpx.get(f"{fuzzed_server.http_url}/healthz", timeout=10), before)
