"""FrontEnd's dating of a sample: when the user said it, not when its whole chunk arrived."""

from __future__ import annotations

import numpy as np
import pytest

from voicebot.audio.rates import LISTEN_RATE
from voicebot.config.stages import EndpointConfig, GateConfig
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


def test_chunks_that_waited_go_through_the_front_end_in_one_trip_as_one_at_a_time_would():
    """A session behind its input hands the front end every waiting chunk at once (Session._listen):
    one worker call and one VAD request, with the same windows, speech probabilities, events and
    arrival dates as those chunks one by one."""
    import asyncio

    from tests.audio import espeak_speech, to_pcm16
    from voicebot.serving.worker import Worker

    audio = np.concatenate([np.zeros(8000, np.float32), espeak_speech("turn on the lights"), np.zeros(16000, np.float32)])
    pcm = to_pcm16(audio)
    step = 2 * 320  # 20 ms chunks at 16 kHz
    chunks = [AudioIn(pcm[i : i + step], 100.0 + i / step * 0.02) for i in range(0, len(pcm), step)]
    batcher, worker = VadBatcher(), Worker("audio", threads=1)
    batcher.start()

    def shape(events):
        """Each utterance's audio (its start's and audio events', which a trip of many chunks
        joins in fewer events) and where its speech ended."""
        utterances, audio = [], []
        for e in events:
            if e.kind.value == "end":
                utterances.append((np.concatenate(audio), e.speech_end_sample))
                audio = []
            else:
                audio.append(e.audio)
        return utterances

    async def heard(runs: list[list[AudioIn]]):
        front = FrontEnd(16000, GateConfig(), EndpointConfig(), vad=batcher)
        calls = []
        prepare = front._prepare
        front._prepare = lambda *c: calls.append(len(c)) or prepare(*c)
        events = []
        for run in runs:
            events += (await front.process(run, worker)).events
        return shape(events + front.end()), calls, [front.time_of_sample(s) for s in (160, 16000, 32000)]

    try:
        one_by_one = asyncio.run(heard([[c] for c in chunks]))
        # 1.2 s of chunks waited behind a stalled trip, then the rest one by one
        behind = asyncio.run(heard([chunks[:60], *([c] for c in chunks[60:])]))
    finally:
        batcher.stop()
        worker.shutdown()
    assert len(behind[0]) == len(one_by_one[0]) >= 1
    for (audio, end), (expected_audio, expected_end) in zip(behind[0], one_by_one[0]):
        assert end == expected_end and np.array_equal(audio, expected_audio)
    assert behind[1] == [60] + [1] * (len(chunks) - 60) and one_by_one[1] == [1] * len(chunks)
    assert behind[2] == pytest.approx(one_by_one[2])
