"""The FunASR 2-pass protocol logic, without sockets: a scripted endpointer and the tiny model."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from tests.asr.tiny_models import synthetic_speech
from voicebot.asr.funasr_protocol import FunasrSession, ProtocolError
from voicebot.audio.endpoint import EventKind, VadEvent
from voicebot.audio.resample import float_to_pcm16

FRAME = 1920  # bytes: the 60 ms frames FunASR clients send


class ScriptedSegmenter:
    """Speech from the first frame; the utterance ends every `utterance_samples` and at force_end."""

    def __init__(self, utterance_samples: int = 10**9) -> None:
        self.utterance_samples = utterance_samples
        self.in_speech = 0

    async def process(self, audio: np.ndarray) -> list[VadEvent]:
        events = []
        if len(audio):
            events.append(VadEvent(EventKind.START if self.in_speech == 0 else EventKind.AUDIO, audio))
            self.in_speech += len(audio)
        if self.in_speech >= self.utterance_samples:
            events += await self.force_end()
        return events

    async def force_end(self) -> list[VadEvent]:
        if not self.in_speech:
            return []
        self.in_speech = 0
        return [VadEvent(EventKind.END, np.zeros(0, np.float32))]


def converse(recognizer, mode: str, pcm: bytes, frame: int = FRAME, segmenter=None) -> list[dict]:
    async def run():
        session = FunasrSession(recognizer, segmenter or ScriptedSegmenter())
        init = {"mode": mode, "chunk_size": [5, 10, 5], "chunk_interval": 10, "wav_name": "clip",
                "wav_format": "pcm", "audio_fs": 16000, "is_speaking": True, "hotwords": "", "itn": True}
        replies = await session.on_text(json.dumps(init))
        for start in range(0, len(pcm), frame):
            replies += await session.on_audio(pcm[start : start + frame])
        replies += await session.on_text(json.dumps({"is_speaking": False}))
        await session.close()
        return replies

    return asyncio.run(run())


PCM = float_to_pcm16(synthetic_speech(4.0, seed=40))


def one_shot(recognizer) -> str:
    return recognizer.streaming.decode_blocking(synthetic_speech(4.0, seed=40)).text


def test_2pass_deltas_then_final(recognizer):
    replies = converse(recognizer, "2pass", PCM)
    online = [r for r in replies if r["mode"] == "2pass-online"]
    offline = [r for r in replies if r["mode"] == "2pass-offline"]
    assert len(online) >= 3 and len(offline) == 1
    # The online deltas are the beginning of the final text; only the last message is final.
    assert offline[0]["text"].startswith("".join(r["text"] for r in online))
    assert offline[0]["text"] == one_shot(recognizer)
    assert [r["is_final"] for r in replies] == [False] * (len(replies) - 1) + [True]
    assert replies[-1] is offline[0] and replies[-1]["asr_model"] == "asr.paraformer.model"
    assert 0 < replies[-1]["confidence"] <= 1 and replies[-1]["fallback"] is None
    assert all(r["wav_name"] == "clip" and "timestamp" not in r for r in replies)


def test_online_deltas_concatenate(recognizer):
    replies = converse(recognizer, "online", PCM)
    assert {r["mode"] for r in replies} == {"online"}
    assert "".join(r["text"] for r in replies) == one_shot(recognizer)
    assert replies[-1]["is_final"] and not any(r["is_final"] for r in replies[:-1])


def test_offline_one_result_per_utterance(recognizer):
    # Three utterances cut by the endpointer, then the client's end (nothing left: empty final).
    replies = converse(recognizer, "offline", PCM, segmenter=ScriptedSegmenter(utterance_samples=16000 * 4 // 3))
    assert [r["mode"] for r in replies] == ["offline"] * len(replies)
    assert len([r for r in replies if r["text"]]) == 3
    assert replies[-1]["is_final"] and not any(r["is_final"] for r in replies[:-1])


def test_frames_splitting_samples_and_8k_input(recognizer):
    # Odd-sized frames split samples across frames: the text must not change.
    assert converse(recognizer, "offline", PCM, frame=1001)[-1]["text"] == one_shot(recognizer)
    pcm_8k = float_to_pcm16(synthetic_speech(2.0, seed=41, sample_rate=8000))

    async def run():
        session = FunasrSession(recognizer, ScriptedSegmenter())
        await session.on_text(json.dumps({"mode": "offline", "audio_fs": 8000}))
        await session.on_audio(pcm_8k)
        return await session.on_text(json.dumps({"is_speaking": False}))

    assert asyncio.run(run())[-1]["is_final"]


def test_is_end_is_acknowledged(recognizer):
    async def run():
        session = FunasrSession(recognizer, ScriptedSegmenter())
        await session.on_text(json.dumps({"mode": "2pass"}))
        await session.on_audio(PCM[:32000])
        return await session.on_text(json.dumps({"is_speaking": False, "is_end": True}))

    last = asyncio.run(run())[-1]
    assert last["is_final"] and last["is_end"] and last["mode"] == "2pass-offline"


@pytest.mark.parametrize("message, complaint", [
    ("{not json", "not JSON"),
    ('["a list"]', "JSON object"),
    ('{"mode": "3pass"}', "mode must be"),
    ('{"wav_format": "mp3"}', "wav_format"),
    ('{"audio_fs": 96000}', "audio_fs"),
])
def test_bad_messages_are_refused_clearly(recognizer, message, complaint):
    session = FunasrSession(recognizer, ScriptedSegmenter())
    with pytest.raises(ProtocolError, match=complaint):
        asyncio.run(session.on_text(message))
