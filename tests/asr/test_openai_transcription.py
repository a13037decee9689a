"""/v1/audio/transcriptions on the Paraformer engine (a confidence per segment), behind a token.

The openai SDK as the client; the tiny random-weight Paraformer, so the text itself is compared
with what the same recognizer makes of the same segments, not with the words spoken.
"""

from __future__ import annotations

import io
import math

import numpy as np
import openai
import pytest
import soundfile

from tests.asr.server import serve
from tests.audio import espeak_speech
from tests.conftest import make_settings

TOKEN = "openai-audio-secret"


@pytest.fixture(scope="module")
def base_url(tiny_models):
    settings = make_settings(asr={"engine": "paraformer", "paraformer": {"model": str(tiny_models["streaming"])}},
                             tts={"voice": "zh"}, server={"token": TOKEN})
    with serve(settings) as port:
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def wav() -> bytes:
    silence = np.zeros(16000, np.float32)
    sentences = [espeak_speech(text, voice="cmn") for text in ("今天天气很好", "我们去公园散步吧")]
    buffer = io.BytesIO()
    soundfile.write(buffer, np.concatenate([silence[:4000], sentences[0], silence, sentences[1], silence]), 16000,
                    format="WAV")
    return buffer.getvalue()


def test_segments_carry_the_recognizers_confidence(base_url, wav):
    client = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=60)
    result = client.audio.transcriptions.create(model="paraformer", file=("zh.wav", wav),
                                                response_format="verbose_json", language="zh")
    assert result.language == "zh" and len(result.segments) == 2
    assert result.text == " ".join(s.text for s in result.segments) and all(s.text for s in result.segments)
    for segment in result.segments:
        extra = segment.model_extra
        assert 0 < extra["confidence"] <= 1 and extra["model"] == "asr.paraformer.model"
        assert segment.avg_logprob == pytest.approx(math.log(extra["confidence"]))
    plain = client.audio.transcriptions.create(model="paraformer", file=("zh.wav", wav))
    assert plain.text == result.text  # the same file, the same segments, the same text


def test_wrong_api_key_is_refused_in_openais_shape(base_url, wav):
    client = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.audio.transcriptions.create(model="paraformer", file=("zh.wav", wav))
    assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.audio.speech.create(model="tts-1", voice="zh", input="你好")
