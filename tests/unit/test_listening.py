"""FrontEnd's dating of a sample: when the user said it, not when its whole chunk arrived."""

from __future__ import annotations

import numpy as np
import pytest

from voicebot.audio.rates import LISTEN_RATE
from voicebot.config import EndpointConfig, GateConfig
from voicebot.messages import AudioIn
from voicebot.serving.vad import VadBatcher
from voicebot.session.listening import FrontEnd


def fed(input_rate: int, chunk_ms: int, arrivals: list[float]) -> FrontEnd:
    """A front end that has taken one chunk of silence per arrival time."""
    front = FrontEnd(input_rate, GateConfig(enabled=False), EndpointConfig(), vad=VadBatcher())
    pcm = np.zeros(input_rate * chunk_ms // 1000, "<i2").tobytes()
    for arrived in arrivals:
        front._prepare(AudioIn(pcm, arrived))  # the worker's part: what dates the samples
    return front


@pytest.mark.parametrize("input_rate", [16000, 48000, 8000])
def test_a_sample_is_dated_within_its_chunk(input_rate):
    # 40 ms chunks (640 samples at 16 kHz) arriving at 10.04 s, 10.08 s, 10.20 s (the last one late).
    front = fed(input_rate, 40, [10.04, 10.08, 10.20])
    assert front.time_of_sample(640) == pytest.approx(10.04)  # the end of a chunk: its arrival
    assert front.time_of_sample(320) == pytest.approx(10.02)  # its middle: 20 ms before
    assert front.time_of_sample(641) == pytest.approx(10.08 - 639 / LISTEN_RATE)  # just into the next
    assert front.time_of_sample(1600) == pytest.approx(10.20 - 0.02)


def test_a_sample_not_yet_arrived_is_dated_now():
    front = fed(16000, 40, [1.0])
    assert front.time_of_sample(641) > 1.0
