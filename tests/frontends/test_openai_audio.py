"""/v1/audio/speech and /v1/audio/transcriptions with the official `openai` SDK as the client, unmodified.

The default config's engines: espeak-ng speaks, pocketsphinx with the test grammar (TEST_PHRASES)
recognizes, so a transcript is deterministic and speech can be checked by recognizing it again.
"""

from __future__ import annotations

import base64
import io
import json
import wave

import av
import numpy as np
import openai
import pytest
import soundfile

from tests.conftest import TEST_PHRASES, speech_pcm

TTS_RATE = 24000


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


def spoken(client: openai.OpenAI, text: str, **options) -> bytes:
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="en", input=text,
                                                            **options) as response:
        assert response.status_code == 200
        return b"".join(response.iter_bytes())


def pcm_float(pcm: bytes) -> np.ndarray:
    assert len(pcm) % 2 == 0
    return np.frombuffer(pcm, "<i2").astype(np.float32) / 32768


def speech_like(audio: np.ndarray, text: str) -> None:
    # espeak at 175 words a minute: a few words last between a fraction of a second and a few seconds
    seconds = len(audio) / TTS_RATE
    assert 0.3 * len(text.split()) / 3 < seconds < len(text.split()) + 1
    assert np.sqrt(np.mean(audio**2)) > 0.02 and np.abs(audio).max() < 1


def wav_file(pcm16: bytes, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(pcm16)
    return buffer.getvalue()


def test_speech_pcm_streams_24k_speech(client):
    text = TEST_PHRASES[0]
    speech_like(pcm_float(spoken(client, text, response_format="pcm")), text)


def test_speech_wav_is_recognized_back(client):
    text = TEST_PHRASES[2]
    data = spoken(client, text, response_format="wav")
    with wave.open(io.BytesIO(data)) as w:  # sizes "unknown": the stream was sent as synthesized
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (TTS_RATE, 1, 2)
        pcm = w.readframes(10**9)
    assert len(pcm) == len(data) - 44
    speech_like(pcm_float(pcm), text)
    # the wav as it came, uploaded for transcription: the grammar's phrase, recognized from our speech
    result = client.audio.transcriptions.create(model="whisper-1", file=("reply.wav", data))
    assert result.text == text


@pytest.mark.parametrize("response_format", ["pcm", "wav"])
def test_speech_sse(client, response_format):
    text = TEST_PHRASES[1]
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="en", input=text,
                                                            response_format=response_format,
                                                            stream_format="sse") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * (len(events) - 1) + ["speech.audio.done"]
    assert len(events) > 2  # one delta per synthesized chunk, sent as they come
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    if response_format == "wav":  # the same bytes as the audio stream: the header first
        assert audio[:4] == b"RIFF" and audio[36:40] == b"data"
        audio = audio[44:]
    speech_like(pcm_float(audio), text)


def test_every_voice(client, server):
    for voice in server.runtime.synthesizer.voices():
        with client.audio.speech.with_streaming_response.create(model="tts-1", voice=voice.name, input="1 2 3",
                                                                response_format="pcm") as response:
            assert len(b"".join(response.iter_bytes())) > TTS_RATE // 10


@pytest.fixture(scope="module")
def two_phrases(tmp_path_factory):
    """Two grammar phrases with a pause between them, as a 16 kHz wav file. (Pocketsphinx carries its
    cepstral mean from one utterance to the next, across requests too; these two phrases are
    recognized whatever came before, "hello there how are you" loses its "you" after some.)"""
    pcm = speech_pcm(TEST_PHRASES[1]) + speech_pcm(TEST_PHRASES[2])
    path = tmp_path_factory.mktemp("openai") / "two.wav"
    path.write_bytes(wav_file(pcm))
    return path


def test_transcription_json_and_text(client, two_phrases):
    expected = f"{TEST_PHRASES[1]} {TEST_PHRASES[2]}"
    with two_phrases.open("rb") as f:
        assert client.audio.transcriptions.create(model="whisper-1", file=f).text == expected
    with two_phrases.open("rb") as f:
        assert client.audio.transcriptions.create(model="whisper-1", file=f, response_format="text").strip() == expected


def test_transcription_verbose_json_segments(client, two_phrases):
    with two_phrases.open("rb") as f:
        result = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="verbose_json",
                                                    timestamp_granularities=["segment"])
    duration = soundfile.info(two_phrases).duration
    assert abs(result.duration - duration) < 0.01
    first, second = result.segments
    assert (first.text, second.text) == (TEST_PHRASES[1], TEST_PHRASES[2])
    # speech_pcm puts 0.3 s of silence before each phrase and 1 s after
    assert 0.0 <= first.start < 0.3 < first.end < second.start < second.end <= duration
    assert second.start > duration / 2 - 0.5
    for segment in (first, second):
        extra = segment.model_extra
        # pocketsphinx has no confidence measure: null (tests/asr/test_openai_transcription.py has one)
        assert extra["confidence"] is None and extra["model"].startswith("pocketsphinx")
        assert segment.temperature == 0.0 and segment.compression_ratio > 0


def test_a_file_in_another_format_and_rate(client):
    pcm = speech_pcm(TEST_PHRASES[1], rate=44100)
    buffer = io.BytesIO()
    soundfile.write(buffer, pcm_float(pcm), 44100, format="FLAC")
    assert client.audio.transcriptions.create(model="m", file=("a.flac", buffer.getvalue())).text == TEST_PHRASES[1]


def decoded(data: bytes) -> tuple[np.ndarray, int, str]:
    """A compressed response decoded by FFmpeg: mono float samples, their rate, the container's name."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        as_float = av.AudioResampler(format="flt", layout="mono")  # flac decodes to s16, the rest to float
        frames = [f.to_ndarray().reshape(-1) for frame in container.decode(stream) for f in as_float.resample(frame)]
        return np.concatenate(frames), stream.codec_context.sample_rate, container.format.name


@pytest.mark.parametrize("response_format, container", [
    ("mp3", "mp3"), ("opus", "ogg"), ("aac", "aac"), ("flac", "flac")])
def test_speech_in_every_compressed_format_openai_has(client, response_format, container):
    """Only wav and pcm were served; mp3 (OpenAI's default), opus, aac and flac were refused."""
    text = TEST_PHRASES[0]
    audio, rate, found = decoded(spoken(client, text, response_format=response_format))
    assert found == container
    # opus decodes at 48 kHz whatever it was fed; the rest keep the synthesizer's 24 kHz
    speech_like(audio[:: rate // TTS_RATE], text)
    assert rate == (48000 if response_format == "opus" else TTS_RATE)


def test_speech_is_mp3_by_default_as_openais(client):
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="en", input=TEST_PHRASES[0]) as response:
        assert response.headers["content-type"] == "audio/mpeg"
        assert decoded(response.read())[2] == "mp3"


def test_speech_sse_in_mp3(client):
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="en", input=TEST_PHRASES[0],
                                                            response_format="mp3", stream_format="sse") as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert events[-1]["type"] == "speech.audio.done"
    speech_like(decoded(audio)[0], TEST_PHRASES[0])


def encoded(pcm16: bytes, rate: int, muxer: str, codec: str) -> bytes:
    """16-bit mono samples as a file of another format, encoded by FFmpeg."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=muxer) as container:
        stream = container.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm16, np.int16).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = rate
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


@pytest.mark.parametrize("name, muxer, codec", [
    ("a.m4a", "ipod", "aac"), ("a.mp4", "mp4", "aac"), ("a.webm", "webm", "libopus"), ("a.mp3", "mp3", "libmp3lame"),
    ("a.ogg", "ogg", "libopus")])
def test_transcription_of_every_file_format_openai_takes(client, name, muxer, codec):
    """m4a, mp4 and webm were refused, the m4a with a Python object's repr in the message."""
    rate = 48000 if codec == "libopus" else 16000
    data = encoded(speech_pcm(TEST_PHRASES[1], rate=rate), rate, muxer, codec)
    assert client.audio.transcriptions.create(model="whisper-1", file=(name, data)).text == TEST_PHRASES[1]


def test_a_file_ffmpeg_cannot_read_is_refused_without_a_python_repr(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.transcriptions.create(model="whisper-1", file=("a.m4a", b"ftypM4A " + b"\0" * 4000))
    message = refused.value.body["message"]
    assert refused.value.body["param"] == "file" and "object at 0x" not in message and "<" not in message


@pytest.mark.parametrize("response_format", ["srt", "vtt"])
def test_transcription_as_subtitles(client, two_phrases, response_format):
    with open(two_phrases, "rb") as f:
        subtitles = client.audio.transcriptions.create(model="whisper-1", file=f, response_format=response_format)
    blocks = subtitles.strip().split("\n\n")
    if response_format == "vtt":
        assert blocks.pop(0) == "WEBVTT"
    assert [b.splitlines()[-1] for b in blocks] == TEST_PHRASES[1:3]
    separator = "," if response_format == "srt" else "."
    for number, block in enumerate(blocks, 1):
        lines = block.splitlines()
        if response_format == "srt":
            assert lines.pop(0) == str(number)
        start, arrow, end = lines[0].split(" ")
        assert arrow == "-->" and separator in start and start < end and len(start) == len("00:00:00,000")


@pytest.mark.parametrize("options, param", [
    ({"voice": "nobody"}, "voice"),
    ({"response_format": "ogg"}, "response_format"),
    ({"speed": 2.0}, "speed"),
    ({"speed": 9.0}, "speed"),
    ({"input": ""}, "input"),
    ({"input": "x" * 4097}, "input"),
])
def test_speech_bad_request(client, options, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.speech.create(**{"model": "tts-1", "voice": "en", "input": "hello"} | options)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize("file, options, status, param", [
    (("notes.txt", b"not audio at all" * 100), {}, 400, "file"),
    (("a.wav", b""), {}, 400, "file"),
    (("a.wav", wav_file(speech_pcm("hello"))), {"response_format": "diarized_json"}, 400, "response_format"),
    (("a.wav", wav_file(speech_pcm("hello"))), {"timestamp_granularities": ["word"]}, 400, "timestamp_granularities"),
])
def test_transcription_bad_request(client, file, options, status, param):
    with pytest.raises(openai.APIStatusError) as refused:
        client.audio.transcriptions.create(model="whisper-1", file=file, **options)
    assert refused.value.status_code == status and refused.value.body["param"] == param


def test_the_server_goes_on_after_bad_requests(client):
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model="tts-1", voice="nobody", input="hello")
    speech_like(pcm_float(spoken(client, TEST_PHRASES[0], response_format="pcm")), TEST_PHRASES[0])


def test_requests_and_their_audio_are_counted(client, server, two_phrases):
    def requests(route: str, outcome: str) -> float:
        return server.metric("voicebot_audio_api_requests_total", f'outcome="{outcome}",route="{route}"')

    def seconds(route: str) -> float:
        return server.metric("voicebot_audio_api_audio_seconds_total", f'route="{route}"')

    before = {k: requests(*k) for k in [("speech", "ok"), ("speech", "400"), ("transcriptions", "ok")]}
    spoken_before, heard_before = seconds("speech"), seconds("transcriptions")
    pcm = spoken(client, TEST_PHRASES[0], response_format="pcm")
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model="tts-1", voice="nobody", input="hello")
    client.audio.transcriptions.create(model="whisper-1", file=two_phrases)
    assert requests("speech", "ok") == before["speech", "ok"] + 1
    assert requests("speech", "400") == before["speech", "400"] + 1
    assert requests("transcriptions", "ok") == before["transcriptions", "ok"] + 1
    assert seconds("speech") - spoken_before == pytest.approx(len(pcm) / 2 / TTS_RATE, abs=1e-3)
    assert seconds("transcriptions") - heard_before == pytest.approx(soundfile.info(two_phrases).duration, abs=0.01)
    assert server.metric("voicebot_audio_api_active") == 0
