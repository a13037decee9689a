"""/v1/audio/speech and /v1/audio/transcriptions with the official `openai` SDK as the client, unmodified.

The default config's engines: espeak-ng speaks, pocketsphinx with the test grammar (TEST_PHRASES)
recognizes, so a transcript is deterministic and speech can be checked by recognizing it again.
"""

from __future__ import annotations

import base64
import io
import json
import wave

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


@pytest.mark.parametrize("options, param", [
    ({"voice": "nobody"}, "voice"),
    ({"response_format": "mp3"}, "response_format"),
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
    (("a.wav", wav_file(speech_pcm("hello"))), {"response_format": "srt"}, 400, "response_format"),
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
