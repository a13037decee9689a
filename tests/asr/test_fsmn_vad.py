"""fsmn-vad as the /funasr endpointer: utterance boundaries, look-back, bounded state."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from tests.asr.tiny_models import synthetic_speech
from voicebot.asr.paraformer import ParaformerRecognizer
from voicebot.audio.endpoint import EventKind
from voicebot.audio.resample import float_to_pcm16
from voicebot.config.engines import ParaformerConfig
from voicebot.frontends.funasr_protocol import FunasrSession
from voicebot.metrics import Metrics

SILENCE = np.zeros(16000, np.float32)


def speech_with_pauses(count: int, seed: int = 0) -> np.ndarray:
    """`count` 2 s utterances, each after 1 s of digital silence (the tiny VAD's idea of silence)."""
    return np.concatenate([part for i in range(count) for part in (SILENCE, synthetic_speech(2.0, seed=seed + i))]
                          + [SILENCE])


@pytest.fixture(scope="module")
def recognizer(tiny_models):
    rec = ParaformerRecognizer(ParaformerConfig(model=str(tiny_models["streaming"]), vad_model=str(tiny_models["vad"])))
    rec.load()
    yield rec
    rec.close()


def segment(segmenter, audio: np.ndarray, piece: int = 1600) -> list:
    async def run():
        events = []
        for start in range(0, len(audio), piece):
            events += await segmenter.process(audio[start : start + piece])
        return events + await segmenter.force_end()

    return asyncio.run(run())


def test_utterances_and_look_back(recognizer):
    events = segment(recognizer.vad.segmenter(), speech_with_pauses(2))
    kinds = [e.kind for e in events if e.kind is not EventKind.AUDIO]
    assert kinds == [EventKind.START, EventKind.END] * 2
    # Speech starts at 1.0 s; the start is detected later, yet the audio handed on begins before it.
    handed_on = sum(len(e.audio) for e in events[: events.index(next(e for e in events if e.kind is EventKind.END))])
    end_sample = next(e for e in events if e.kind is EventKind.END).speech_end_sample
    assert end_sample - handed_on < 16000  # the first utterance's audio starts before 1.0 s
    assert 3 * 16000 <= end_sample <= 3.5 * 16000  # and ends just after the speech does (3.0 s)


def test_state_stays_bounded(recognizer):
    segmenter = recognizer.vad.segmenter()
    audio = speech_with_pauses(40, seed=100)  # 2 minutes, 1200 pieces of 100 ms
    sizes = []

    async def run():
        for start in range(0, len(audio), 1600):
            await segmenter.process(audio[start : start + 1600])
            sizes.append(segmenter.state_bytes())

    asyncio.run(run())
    assert max(sizes[-400:]) <= max(sizes[:400])
    # Between utterances the state returns to the same size: funasr's per-segment records (~1 KB
    # per utterance without the fresh cache after each segment) do not pile up.
    assert min(sizes[-400:]) <= min(sizes[:400]) + 512


def test_funasr_session_ends_utterances_by_fsmn_vad(recognizer):
    pcm = float_to_pcm16(speech_with_pauses(3, seed=200))

    async def run():
        session = FunasrSession(recognizer, recognizer.vad.segmenter(), Metrics())
        replies = await session.on_text(json.dumps({"mode": "2pass", "wav_name": "w"}))
        for start in range(0, len(pcm), 1920):
            replies += await session.on_audio(pcm[start : start + 1920])
        return replies + await session.on_text(json.dumps({"is_speaking": False}))

    replies = asyncio.run(run())
    finals = [r for r in replies if r["mode"] == "2pass-offline"]
    assert len([r for r in finals if r["text"]]) == 3 and replies[-1]["is_final"]
