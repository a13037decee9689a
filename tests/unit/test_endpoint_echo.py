"""The front end's endpoint rule where the echo canceller's suppressor hid part of the words (issue 29):
what it hid reaches the endpointer at the windows where it hid it (voicebot/session/listening.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tests.audio import espeak_speech, to_pcm16
from voicebot.asr.base import Hypothesis, RecognizerStream
from voicebot.audio.echo import Cancelled
from voicebot.audio.echo_onset import EchoOnset
from voicebot.audio.endpoint import HELD_SILENCE_SHARE, WINDOW, WINDOW_MS, EventKind
from voicebot.config.stages import EndpointConfig, GateConfig
from voicebot.messages import AudioIn
from voicebot.metrics import Metrics
from voicebot.session.listening import FrontEnd, Listening
from voicebot.session.outbox import Outbox

RATE = 16000


class HoleCanceller:
    """A suppressor that takes `hole` (stream samples) of the input to its floor, -90 dBFS; the linear
    output is the input. `suppressing`: whether it says it suppresses (the reply playing)."""

    def __init__(self, hole: slice, suppressing: bool) -> None:
        self.hole, self.suppressing, self._at = hole, suppressing, 0

    def process(self, audio: np.ndarray, arrived: float | None = None) -> Cancelled:
        positions = np.arange(self._at, self._at + len(audio))
        self._at += len(audio)
        floor = np.random.default_rng(self._at).normal(0, 10 ** (-90 / 20), len(audio)).astype(np.float32)
        inside = (positions >= self.hole.start) & (positions < self.hole.stop)
        return Cancelled(np.where(inside, floor, audio), audio)


@pytest.mark.parametrize("suppressing, utterances", [(True, 1), (False, 2)])
def test_words_the_suppressor_hid_are_one_utterance_where_it_suppressed(input_clock, suppressing, utterances):
    # 0.7 s from inside the words taken to the floor: more than endpoint_silence_ms (500), less than twice it.
    words = espeak_speech("what time does the show start tomorrow") * 0.5
    lead = RATE // 2
    audio = np.concatenate([np.zeros(lead, np.float32), words, np.zeros(2 * RATE, np.float32)])
    hole = slice(lead + len(words) // 2 - RATE * 35 // 100, lead + len(words) // 2 + RATE * 35 // 100)

    async def run() -> list:
        front = FrontEnd(RATE, GateConfig(enabled=False), EndpointConfig(), HoleCanceller(hole, suppressing))
        events = []
        for start in range(0, len(audio), 3200):  # 200 ms chunks
            events += (await front.process(AudioIn(to_pcm16(audio[start : start + 3200]), time.monotonic()), input_clock)).events
        return events

    events = asyncio.run(run())
    kinds = [e.kind for e in events]
    assert kinds.count(EventKind.START) == utterances and kinds.count(EventKind.END) == utterances
    end = events[-1]
    # The hole was inside the words: nothing of it left after their last speech, so the end is not late.
    assert end.held_ms == 0 and end.speech_end_sample >= lead + len(words) - RATE // 5


def noise(dbfs: float) -> np.ndarray:
    return (np.random.default_rng(3).standard_normal(WINDOW) * 10 ** (dbfs / 20)).astype(np.float32)


@pytest.mark.parametrize("suppressed_dbfs, linear_dbfs, suppressing, hid", [
    (-90, -30, True, True),  # words (or the echo) at the suppressor's floor
    (-90, -30, False, False),  # no reply playing: nothing is the suppressor's
    (-40, -30, True, False),  # the suppressor let them through, 10 dB down
    (-90, -60, True, False),  # a microphone's noise floor: the user's silence
])
def test_what_the_suppressor_hid(suppressed_dbfs, linear_dbfs, suppressing, hid):
    onset = EchoOnset()
    onset.observe(noise(suppressed_dbfs), suppressing)
    assert onset.hid(noise(linear_dbfs)) is hid


class Transcript(RecognizerStream):
    """A recognizer that hears nothing and finishes every utterance with the same words."""

    async def accept(self, pcm: np.ndarray) -> str | None:
        return None

    async def finish(self) -> Hypothesis:
        return Hypothesis("what time does the show start", 0.9, "fixed")

    async def reset(self):
        raise AssertionError("not reset in this test")

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("suppressing", [True, False])
def test_how_late_the_suppressor_made_an_utterance_end_is_a_metric(input_clock, suppressing):
    # After the words the reply's echo goes on (-40 dBFS noise here: in the linear output, not speech to
    # Silero) and the suppressor takes it to its floor, as it would words: the utterance ends
    # HELD_SILENCE_SHARE of endpoint_silence_ms late, and voicebot_endpoint_held_seconds says so. Where the
    # canceller does not suppress (the reply over), nothing is held.
    words = espeak_speech("what time does the show start tomorrow") * 0.5
    lead = RATE // 2
    echo = np.random.default_rng(4).standard_normal(2 * RATE).astype(np.float32) * 10 ** (-40 / 20)
    audio = np.concatenate([np.zeros(lead, np.float32), words, echo])
    metrics = Metrics()

    async def run() -> list:
        front = FrontEnd(RATE, GateConfig(enabled=False), EndpointConfig(), HoleCanceller(slice(lead + len(words), len(audio)), suppressing))
        listening = Listening(front, Transcript(), input_clock, metrics, Outbox(metrics), "s1")
        utterances = []
        for start in range(0, len(audio), 3200):
            utterances += await listening.hear(AudioIn(to_pcm16(audio[start : start + 3200]), time.monotonic()))
        return utterances

    assert len(asyncio.run(run())) == 1
    held_s = (EndpointConfig().endpoint_silence_ms * HELD_SILENCE_SHARE // WINDOW_MS) * WINDOW_MS / 1000 if suppressing else 0.0
    assert metrics.registry.get_sample_value("voicebot_endpoint_held_seconds_count") == 1
    assert metrics.registry.get_sample_value("voicebot_endpoint_held_seconds_sum") == pytest.approx(held_s)
