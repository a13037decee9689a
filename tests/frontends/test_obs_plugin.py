"""The obs-audio-to-websocket wire format: header parsing, downmix and resampling, bad messages."""

from __future__ import annotations

import asyncio
import json
import struct

import numpy as np
import pytest
import websockets

from tests.browser.support import obs_audio_message, speech
from tests.frontends.fakes import RecordingSession
from voicebot.audio.resample import StreamResampler
from voicebot.metrics import Metrics
from voicebot.frontends.obs_plugin import HEADER, BadChunk, ObsAudio, ObsFrontEnd, parse_chunk
from voicebot.protocol import EndInput
from voicebot.session.commands import AudioChunk


def test_parse_a_message_as_the_plugin_sends_it():
    stereo = np.stack([np.linspace(-0.5, 0.5, 1024), np.zeros(1024)], axis=1)
    chunk = parse_chunk(obs_audio_message(stereo, rate=48000, timestamp_ns=123, source="Mic/Aux"))
    assert (chunk.timestamp_ns, chunk.sample_rate, chunk.channels) == (123, 48000, 2)
    assert chunk.source_id == chunk.source_name == "Mic/Aux"
    assert len(chunk.pcm) == 1024 * 2 * 2


def header(rate=48000, channels=2, bits=16, id_len=0, name_len=0) -> bytes:
    return HEADER.pack(0, rate, channels, bits, id_len, name_len)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "truncated_header"),
        (header()[:27], "truncated_header"),
        (header(rate=0), "bad_sample_rate"),
        (header(channels=0), "bad_channels"),
        (header(channels=9), "bad_channels"),
        (header(bits=32), "bad_bit_depth"),
        (header(id_len=2**31), "bad_names"),
        (header(id_len=10, name_len=10) + b"short", "truncated_names"),
        (header() + b"\x00\x00\x00", "partial_frame"),  # not a whole stereo frame
        (header(rate=8000, channels=1) + b"\x00\x00" * 8001, "chunk_too_large"),
    ],
)
def test_bad_messages_are_named(data, reason):
    with pytest.raises(BadChunk) as exc:
        parse_chunk(data)
    assert exc.value.reason == reason


def test_names_that_are_not_utf8_do_not_matter():
    chunk = parse_chunk(header(channels=1, id_len=2, name_len=0) + b"\xff\xfe" + b"\x01\x00")
    assert chunk.source_id == "\ufffd\ufffd" and len(chunk.pcm) == 2


def test_downmix_and_resample_to_16_khz_mono():
    mono = speech("hello there how are you", rate=48000)
    stereo = np.stack([mono + 0.1, mono - 0.1], axis=1)  # the channels average to `mono`
    audio = ObsAudio()
    out = b"".join(audio.convert(parse_chunk(obs_audio_message(stereo[i : i + 1024]))) for i in range(0, len(stereo), 1024))
    got = np.frombuffer(out, "<i2").astype(np.float32) / 32768
    # Chunk by chunk equals resampling the whole downmixed signal at once.
    whole = StreamResampler(48000, 16000).process(np.round(mono * 32767) / 32768)
    assert len(got) == len(whole)
    assert np.abs(got - whole).max() < 3 / 32768  # rounding to s16 on both sides


def test_the_plugin_as_a_voice_session():
    """The session opens with session.start on the channel, audio becomes 16 kHz PCM, stop becomes
    input.end, and a bad message (or a start) is counted and skipped without a socket."""
    quiet = np.full((1024, 2), 0.1, np.float32)
    incoming = [
        json.dumps({"type": "start", "timestamp": 1}),
        b"\x01\x02\x03",
        *(obs_audio_message(quiet) for _ in range(3)),
        "not json",
        json.dumps({"type": "stop", "timestamp": 2}),
    ]
    metrics = Metrics()
    front_end = ObsFrontEnd("main", metrics)
    session = RecordingSession()

    async def drain() -> None:
        await front_end.start(session)
        for message in incoming:
            await front_end.on_message(session, message)

    asyncio.run(drain())
    out = session.commands
    assert out[0].model_dump(exclude_none=True) == {"type": "session.start", "sample_rate": 16000, "channel": "main",
                                                    "echo_cancellation": True}
    audio = [c.pcm for c in out if isinstance(c, AudioChunk)]
    assert audio and all(audio) and sum(map(len, audio)) <= 3 * 1024 // 3 * 2
    assert out[-1] == EndInput(type="input.end")
    assert len(out) == 2 + len(audio)
    assert metrics.obs_bad_chunks.labels("truncated_header")._value.get() == 1
    assert metrics.obs_bad_chunks.labels("bad_control")._value.get() == 1
    assert front_end.source == "Mic/Aux"


def test_plugin_stream_is_transcribed_on_its_channel(server):
    """Through the real server: a listener on the channel sees what the plugin's audio said."""

    async def scenario() -> list[dict]:
        mono = speech(0.3, "hello there how are you", 1.2, rate=48000)
        stereo = np.stack([mono, 0.5 * mono], axis=1)
        # max_queue=None: the reply's frames keep coming after the test stops reading; a bounded
        # client queue would stop reading the socket and wait 10 s for the close handshake.
        async with websockets.connect(f"{server.ws_url}?role=listener&channel=obs-test", max_queue=None) as listener:
            await listener.recv()  # listener.ready
            obs_url = server.ws_url.replace("/v1/voice", "/obs/audio?channel=obs-test")
            async with websockets.connect(obs_url) as plugin:
                await plugin.send(json.dumps({"type": "start", "timestamp": 0}))
                for i in range(0, len(stereo), 1024):
                    await plugin.send(obs_audio_message(stereo[i : i + 1024], timestamp_ns=i * 10**9 // 48000))
                    await asyncio.sleep(1024 / 48000 / 2)  # twice real time
                events = []
                while not any(e["type"] == "asr.final" for e in events):
                    message = await asyncio.wait_for(listener.recv(), 20)
                    if isinstance(message, str):
                        events.append(json.loads(message))
                await plugin.send(json.dumps({"type": "stop", "timestamp": 0}))
        return events

    events = asyncio.run(scenario())
    assert [e["text"] for e in events if e["type"] == "asr.final"] == ["hello there how are you"]
    assert next(e for e in events if e["type"] == "session.ready")["input_sample_rate"] == 16000


def test_header_layout_matches_the_plugin_source():
    # websocketpp-client.cpp writes: timestamp(8) sampleRate(4) channels(4) bitDepth(4) idLen(4) nameLen(4), little-endian
    assert HEADER.size == 28
    assert HEADER.pack(1, 2, 3, 4, 5, 6) == struct.pack("<Q", 1) + b"".join(struct.pack("<I", v) for v in (2, 3, 4, 5, 6))
