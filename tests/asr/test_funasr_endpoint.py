"""funasr-client (async API) against the server's /funasr on 127.0.0.1, in all three modes.

The real app: tiny Paraformer as `asr.engine: paraformer`, the server's Silero endpointer, and
espeak-ng Mandarin speech with pauses, so utterances end by VAD as well as by the client.
funasr-client's merged result keeps only `2pass-offline` messages, as the C++ server labels its
final results in every mode; with no second-pass model configured every mode must merge to the
same transcript.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import numpy as np
import pytest
import soundfile

from tests.asr.server import serve
from tests.audio import espeak_speech, to_pcm16
from tests.conftest import RunningServer, make_settings, running_server
from voicebot.protocol import CloseCode

TOKEN = "funasr-secret"
FINAL_MODES = {"2pass-online", "2pass-offline"}


@pytest.fixture(scope="module")
def server_url(tiny_models):
    settings = make_settings(asr={"engine": "paraformer", "paraformer": {"model": str(tiny_models["streaming"])}},
                             tts={"voice": "zh"}, server={"token": TOKEN})
    with serve(settings) as port:
        yield f"ws://127.0.0.1:{port}/funasr"


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    silence = np.zeros(16000, np.float32)
    sentences = [espeak_speech(text, voice="cmn") for text in ("今天天气很好", "我们去公园散步吧")]
    return np.concatenate([silence[:4000], sentences[0], silence, sentences[1], silence])


@pytest.fixture(scope="module")
def audio_file(speech, tmp_path_factory):
    """The two sentences as a file in a format funasr-client names by its extension."""
    directory = tmp_path_factory.mktemp("funasr-client")

    # The same 16-bit samples in every lossless file (libsndfile's float-to-int rounding differs
    # between its wav and flac encoders, and one LSB changes a random-weight model's text).
    samples = np.frombuffer(to_pcm16(speech), "<i2")

    def write(suffix: str):
        path = directory / f"two-sentences.{suffix}"
        if not path.exists():
            soundfile.write(path, samples if suffix in ("wav", "flac") else speech, 16000)
        return path

    return write


def with_token(url: str) -> str:
    # funasr-client and the HTML5 page take a URL: the token goes in its query
    return f"{url}?token={TOKEN}"


def stream(url: str, path, mode: str) -> list[dict]:
    from funasr_client import async_file_asr_stream

    async def run():
        return [m async for m in async_file_asr_stream(path, with_token(url), mode=mode)]

    return asyncio.run(asyncio.wait_for(run(), 60))


def merged(url: str, path, mode: str) -> dict:
    from funasr_client import async_file_asr

    return asyncio.run(asyncio.wait_for(async_file_asr(path, with_token(url), mode=mode), 60))


def well_formed(messages: list[dict], name: str = "two-sentences.wav") -> None:
    assert messages, "no messages"
    for message in messages:
        assert message["mode"] in FINAL_MODES and message["wav_name"] == name
        assert isinstance(message["text"], str) and isinstance(message["is_final"], bool)
        assert "error" not in message
    assert messages[-1]["is_final"] and not any(m["is_final"] for m in messages[:-1])


def finals(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m["mode"] == "2pass-offline" and m["text"]]


@pytest.fixture(scope="module")
def transcript(server_url, audio_file) -> str:
    """The 2pass result: one final per sentence, each after its VAD endpoint."""
    messages = stream(server_url, audio_file("wav"), "2pass")
    well_formed(messages)
    assert len(finals(messages)) == 2 and any(m["mode"] == "2pass-online" for m in messages)
    assert all(0 < m["confidence"] <= 1 and m["asr_model"] == "asr.paraformer.model" for m in finals(messages))
    return "".join(m["text"] for m in finals(messages))


@pytest.mark.parametrize("mode", ["2pass", "online", "offline"])
def test_merged_result_in_every_mode(server_url, audio_file, transcript, mode):
    result = merged(server_url, audio_file("wav"), mode)
    assert result["text"] == transcript != "" and result["is_final"]


def test_online_deltas_are_the_finals(server_url, audio_file, transcript):
    messages = stream(server_url, audio_file("wav"), "online")
    well_formed(messages)
    assert len(finals(messages)) == 2
    assert "".join(m["text"] for m in messages if m["mode"] == "2pass-online") == transcript


def test_offline_sends_finals_only(server_url, audio_file, transcript):
    messages = stream(server_url, audio_file("wav"), "offline")
    well_formed(messages)
    assert {m["mode"] for m in messages} == {"2pass-offline"} and len(finals(messages)) == 2


def test_runtime_clients_root_path(server_url, audio_file, transcript):
    # The runtime's own clients cannot add a path: they connect to ws://host:port/.
    root = server_url.removesuffix("funasr")
    assert merged(root, audio_file("wav"), "2pass")["text"] == transcript


def test_any_other_path_is_the_funasr_runtime_too(server_url, audio_file, transcript):
    # The C++ server accepts any path; FunASR's HTML5 client suggests ws://host:port/wss/.
    root = server_url.removesuffix("funasr")
    assert merged(root + "wss/", audio_file("wav"), "2pass")["text"] == transcript


def test_lossless_file_decoded_as_the_same_speech(server_url, audio_file, transcript):
    # funasr-client sends a .flac as it is, wav_format "flac": decoded, not taken for PCM
    messages = stream(server_url, audio_file("flac"), "offline")
    well_formed(messages, name="two-sentences.flac")
    assert "".join(m["text"] for m in finals(messages)) == transcript


def test_mp3_file_decoded(server_url, audio_file):
    messages = stream(server_url, audio_file("mp3"), "offline")
    well_formed(messages, name="two-sentences.mp3")
    assert finals(messages)  # lossy: other samples, so other text from random weights; but speech


def test_a_file_in_2pass_mode_is_decoded(server_url, audio_file, transcript):
    # funasr-client sends the extension as wav_format in every mode; the file's audio is streamed
    messages = stream(server_url, audio_file("flac"), "2pass")
    well_formed(messages, name="two-sentences.flac")
    assert "".join(m["text"] for m in finals(messages)) == transcript


def test_the_runtime_clients_others_file_is_decoded_and_its_end_acknowledged(server_url, audio_file, transcript):
    # funasr_wss_client.py (runtime/python/websocket): wav_format "others" for a file that is not
    # .wav/.pcm, sent in 19200-byte pieces, then {"is_speaking": false, "is_end": true}; it waits
    # for a message with is_end and reads is_final from it.
    import websockets

    async def run():
        async with websockets.connect(with_token(server_url)) as ws:
            await ws.send(json.dumps({"mode": "2pass", "chunk_size": [5, 10, 5], "chunk_interval": 10,
                                      "audio_fs": 16000, "wav_name": "demo", "wav_format": "others",
                                      "is_speaking": True, "hotwords": "", "itn": True}))
            data = audio_file("flac").read_bytes()
            for start in range(0, len(data), 19200):
                await ws.send(data[start : start + 19200])
            await ws.send(json.dumps({"is_speaking": False, "is_end": True}))
            messages = []
            while not (messages and messages[-1].get("is_end")):
                messages.append(json.loads(await ws.recv()))
            return messages

    messages = asyncio.run(asyncio.wait_for(run(), 60))
    assert messages[-1]["is_final"] and "error" not in messages[-1]
    assert "".join(m["text"] for m in messages if m["mode"] == "2pass-offline") == transcript


def test_without_the_token_refused(server_url, audio_file):
    from funasr_client import async_file_asr_stream

    async def run():
        return [m async for m in async_file_asr_stream(audio_file("wav"), server_url, mode="offline")]

    from websockets.exceptions import ConnectionClosedError

    with pytest.raises(ConnectionClosedError) as refused:
        asyncio.run(asyncio.wait_for(run(), 30))
    assert refused.value.rcvd.code == 4401 and refused.value.rcvd.reason == "unauthorized"


def test_a_refusal_comes_in_funasrs_shape(server_url):
    # A final error result, read as any result is (the runtime's clients and HTML5 page read mode,
    # wav_name, text and is_final: a voicebot error event has none of them), then the close.
    import websockets

    async def run():
        async with websockets.connect(server_url) as ws:  # no token
            return json.loads(await ws.recv())

    refusal = asyncio.run(asyncio.wait_for(run(), 30))
    assert refusal["mode"] == "2pass-offline" and refusal["is_final"] and refusal["text"] == f"ERROR. {refusal['error']}"
    assert refusal["code"] == "unauthorized" and "wav_name" in refusal and "type" not in refusal


def test_wss_with_a_self_signed_certificate(tiny_models, audio_file, transcript, tmp_path):
    # docs/funasr.md's set-up: the openssl command, uvicorn serving TLS; funasr-client does not verify
    key, cert = tmp_path / "server.key", tmp_path / "server.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=voicebot",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    settings = make_settings(asr={"engine": "paraformer", "paraformer": {"model": str(tiny_models["streaming"])}},
                             tts={"voice": "zh"}, server={"token": TOKEN})
    with serve(settings, ssl_keyfile=str(key), ssl_certfile=str(cert)) as port:
        result = merged(f"wss://127.0.0.1:{port}/funasr", audio_file("wav"), "2pass")
    assert result["text"] == transcript and result["is_final"]


def test_the_batched_engine_serves_the_same_transcript(tiny_models, audio_file, transcript):
    # asr.engine paraformer-batched: our implementation of the same model, sessions batched
    settings = make_settings(asr={"engine": "paraformer-batched", "paraformer": {"model": str(tiny_models["streaming"])}},
                             tts={"voice": "zh"}, server={"token": TOKEN})
    with serve(settings) as port:
        messages = stream(f"ws://127.0.0.1:{port}/funasr", audio_file("wav"), "2pass")
    well_formed(messages)
    assert "".join(m["text"] for m in finals(messages)) == transcript


def test_a_client_that_ends_twice_and_closes_leaves_no_traceback(server_url, caplog):
    # Every way a socket ends is handled by the one receive loop (voicebot/transport.py); a client
    # that sends its end twice and closes at once must not show up as an error in the server log.
    import websockets

    async def run():
        async with websockets.connect(f"{server_url}?token={TOKEN}") as ws:
            await ws.send('{"mode": "offline", "wav_name": "w", "is_speaking": true}')
            await ws.send(to_pcm16(np.zeros(8000, np.float32)))
            await ws.send('{"is_speaking": false}')
            await ws.send('{"is_speaking": false}')
        await asyncio.sleep(0.5)  # the server reads, answers into the closed socket, and ends

    with caplog.at_level("DEBUG"):
        asyncio.run(asyncio.wait_for(run(), 30))
    assert not [r for r in caplog.records if r.exc_info or r.levelname in ("ERROR", "CRITICAL")], caplog.text


# ---- an overloaded VAD and a failing recognizer, under funasr-client ------------------------------

@pytest.fixture(scope="module")
def open_server(tiny_models):
    """The same app without a token, its runtime at hand (tests/conftest.running_server)."""
    settings = make_settings(asr={"engine": "paraformer", "paraformer": {"model": str(tiny_models["streaming"])}},
                             tts={"voice": "zh"})
    with running_server(settings) as server:
        yield server


class FullAt:
    """The server's VAD batcher as it is, but full for its `at`-th request (0-based): its own bound
    set to 0 for that one call, so the real check refuses it."""

    def __init__(self, batcher, at: int) -> None:
        self.batcher, self.at, self.calls, self.submit = batcher, at, 0, batcher.submit

    def __call__(self, vad, windows):
        self.calls += 1
        if self.calls - 1 != self.at:
            return self.submit(vad, windows)
        bound, self.batcher.max_pending = self.batcher.max_pending, 0
        try:
            return self.submit(vad, windows)
        finally:
            self.batcher.max_pending = bound


def metric_values(server: RunningServer) -> dict[str, float]:
    return {"overloads": server.metric("voicebot_engine_overloads_total", 'engine="vad"'),
            "dropped": server.metric("voicebot_input_dropped_seconds_total", 'reason="overload"'),
            "busy": server.metric("voicebot_errors_total", 'code="busy"'),
            "vad_failures": server.metric("voicebot_engine_failures_total", 'engine="vad",stage="chunk"')}


def test_a_full_vad_batcher_loses_one_utterance_and_the_stream_goes_on(open_server, audio_file, speech):
    url = f"ws://127.0.0.1:{open_server.settings.server.port}/funasr"
    first_sentence = espeak_speech("今天天气很好", voice="cmn")
    # funasr-client sends a wav in 60 ms frames, each one VAD request: this one is inside the first sentence.
    at = (4000 + len(first_sentence) // 2) // 960
    batcher = open_server.runtime.vad
    before = metric_values(open_server)
    batcher.submit = FullAt(batcher, at)  # an instance attribute: what VadBatcher.probabilities calls
    try:
        messages = stream(url, audio_file("wav"), "2pass")
    finally:
        del batcher.submit
    (busy,) = [m for m in messages if "error" in m]
    assert busy["code"] == "busy" and busy["overloaded"] == "vad" and busy["retry_after_s"] > 0
    assert busy["mode"] == "2pass-offline" and busy["text"] == "" and not busy["is_final"]
    # The first sentence is lost (its end was the notice); the second is recognised; one final at the end.
    after_busy = messages[messages.index(busy) + 1 :]
    assert not [m for m in messages[: messages.index(busy)] if m["mode"] == "2pass-offline"]
    assert len(finals(after_busy)) == 1 and any(m["mode"] == "2pass-online" for m in after_busy)
    assert messages[-1]["is_final"] and sum(m["is_final"] for m in messages) == 1
    after = metric_values(open_server)
    assert after["overloads"] == before["overloads"] + 1 and after["busy"] == before["busy"] + 1
    assert after["vad_failures"] == before["vad_failures"]  # capacity, not a broken engine
    # The whole first utterance: what was heard of it, the refused frame, and the rest of it.
    assert after["dropped"] - before["dropped"] >= 0.9 * len(first_sentence) / 16000


class FailingFinish:
    """The server's recognizer, its streams' finish raising (the offline pass, the fallback...)."""

    def __init__(self, real) -> None:
        self.real = real

    def open(self, language=None):
        stream = self.real.open(language)

        async def finish():
            raise RuntimeError("the second pass broke")

        stream.finish = finish
        return stream

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_recognizer_failing_at_an_utterances_end_is_named_and_counted(open_server, audio_file):
    from funasr_client import async_file_asr_stream
    from websockets.exceptions import ConnectionClosedError

    url = f"ws://127.0.0.1:{open_server.settings.server.port}/funasr"
    rt = open_server.runtime

    def failures() -> float:
        return open_server.metric("voicebot_engine_failures_total", 'engine="asr",stage="finish"')

    counted = failures()
    lost_before = open_server.metric("voicebot_input_dropped_seconds_total", 'reason="engine_error"')
    received = []

    async def run():
        async for message in async_file_asr_stream(audio_file("wav"), url, mode="2pass"):
            received.append(message)

    real = rt.recognizer
    open_server.on_loop(lambda: setattr(rt, "recognizer", FailingFinish(real)))
    try:
        with pytest.raises(ConnectionClosedError) as closed:  # the server closes while funasr-client still sends
            asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        open_server.on_loop(lambda: setattr(rt, "recognizer", real))
    # funasr-client sends its next chunk before it reads what came in: when the error result and the
    # close arrive between its read and that send, the send raises first and the result is never
    # yielded (about one run in two). The error result over a socket is also checked where the
    # client reads it for sure (test_faults.py, a VAD failure); here, when the client kept it, it is the error.
    if received and received[-1]["is_final"]:
        final = received[-1]
        assert final["text"].startswith("ERROR. an engine failed") and "second pass broke" in final["error"]
        assert final["engine"] == "asr" and final["stage"] == "finish"
    assert closed.value.rcvd.code == CloseCode.INTERNAL_ERROR and closed.value.rcvd.reason == "engine_error"
    assert failures() == counted + 1
    # The first utterance, with no transcript: counted as lost.
    lost = open_server.metric("voicebot_input_dropped_seconds_total", 'reason="engine_error"') - lost_before
    assert lost >= 0.9 * len(espeak_speech("今天天气很好", voice="cmn")) / 16000
