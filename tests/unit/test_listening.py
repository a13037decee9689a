"""FrontEnd's dating of a sample: when the user said it, not when its whole chunk arrived; and where an
utterance spoken over the bot's echo began (EchoOnset)."""

from __future__ import annotations

import numpy as np
import pytest

from voicebot.audio.rates import LISTEN_RATE
from voicebot.config.stages import EndpointConfig, GateConfig
from voicebot.messages import AudioIn
from voicebot.audio.endpoint import WINDOW, WINDOW_MS
from voicebot.audio.echo_onset import ECHO_MARGIN_MS, ECHO_REACH_S, EchoOnset
from voicebot.session.listening import FrontEnd


def fed(input_rate: int, chunk_ms: int, arrivals: list[float]) -> FrontEnd:
    """A front end that has taken one chunk of silence per arrival time."""
    front = FrontEnd(input_rate, GateConfig(enabled=False), EndpointConfig())
    pcm = np.zeros(input_rate * chunk_ms // 1000, "<i2").tobytes()
    for arrived in arrivals:
        front.prepare(AudioIn(pcm, arrived))  # the input clock's part: what dates the samples
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


def test_chunks_that_waited_go_through_the_front_end_in_one_trip_as_one_at_a_time_would(input_clock):
    """A session behind its input hands the front end every waiting chunk at once (Session._listen):
    one job at the input clock's tick, with the same windows, speech probabilities, events and
    arrival dates as those chunks one by one."""
    import asyncio

    from tests.audio import espeak_speech, to_pcm16

    audio = np.concatenate([np.zeros(8000, np.float32), espeak_speech("turn on the lights"), np.zeros(16000, np.float32)])
    pcm = to_pcm16(audio)
    step = 2 * 320  # 20 ms chunks at 16 kHz
    chunks = [AudioIn(pcm[i : i + step], 100.0 + i / step * 0.02) for i in range(0, len(pcm), step)]

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
        front = FrontEnd(16000, GateConfig(), EndpointConfig())
        calls = []
        prepare = front.prepare
        front.prepare = lambda *c: calls.append(len(c)) or prepare(*c)
        events = []
        for run in runs:
            events += (await front.process(run, input_clock)).events
        return shape(events + front.end()), calls, [front.time_of_sample(s) for s in (160, 16000, 32000)]

    one_by_one = asyncio.run(heard([[c] for c in chunks]))
    # 1.2 s of chunks waited behind a stalled trip, then the rest one by one
    behind = asyncio.run(heard([chunks[:60], *([c] for c in chunks[60:])]))
    assert len(behind[0]) == len(one_by_one[0]) >= 1
    for (audio, end), (expected_audio, expected_end) in zip(behind[0], one_by_one[0]):
        assert end == expected_end and np.array_equal(audio, expected_audio)
    assert behind[1] == [60] + [1] * (len(chunks) - 60) and one_by_one[1] == [1] * len(chunks)
    assert behind[2] == pytest.approx(one_by_one[2])


def onset_after(levels_db: list[float], suppressing: bool = True) -> EchoOnset:
    """An EchoOnset that has observed one window of each level (white noise at that dBFS, fixed seed)."""
    onset = EchoOnset()
    rng = np.random.default_rng(3)
    for level in levels_db:
        onset.observe((rng.standard_normal(WINDOW) * 10 ** (level / 20)).astype(np.float32), suppressing)
    return onset


MARGIN = ECHO_MARGIN_MS * LISTEN_RATE // 1000


def test_an_utterance_over_the_echo_reaches_back_to_where_the_suppressed_words_began():
    # 2 s of the suppressor's floor (-65 dBFS), then 0.5 s of what it left of the words (-45, with a
    # 96 ms gap at the floor between two of them), then the endpoint rule's utterance: its pre-roll
    # (9 windows) and 5 windows of speech it heard (-25).
    floor, words = [-65.0] * 62, [-45.0] * 6 + [-65.0] * 3 + [-45.0] * 7
    levels = floor + words + [-45.0] * 9 + [-25.0] * 5
    end = len(levels) * WINDOW
    start = end - 14 * WINDOW
    assert onset_after(levels).start(start, end, 0) == (len(floor) * WINDOW) - MARGIN
    # Never into the utterance before it (ended 0.4 s before the words here): its audio was that one's.
    assert onset_after(levels).start(start, end, (len(floor) + 12) * WINDOW) == (len(floor) + 12) * WINDOW
    # The canceller not suppressing (no echo canceller, no echo found, the reply long over): the endpoint rule's start.
    assert onset_after(levels, suppressing=False).start(start, end, 0) == start


def test_the_reach_back_stops_at_a_long_gap_and_at_its_bound():
    # A burst 0.4 s before the words (more than ECHO_GAP_MS of floor between): not theirs.
    levels = [-65.0] * 62 + [-45.0] * 2 + [-65.0] * 13 + [-45.0] * 10 + [-25.0] * 5
    end = len(levels) * WINDOW
    assert onset_after(levels).start(end - 9 * WINDOW, end, 0) == end - 15 * WINDOW - MARGIN
    # Words going on for 1.6 s before the utterance: no more than ECHO_REACH_S (and ECHO_MARGIN_MS) before the endpoint rule's start.
    levels = [-65.0] * 40 + [-45.0] * 50 + [-25.0] * 5
    end = len(levels) * WINDOW
    start = end - 14 * WINDOW
    assert onset_after(levels).start(start, end, 0) == start - round(ECHO_REACH_S * 1000 / WINDOW_MS) * WINDOW - MARGIN
    # Nothing over the floor before the speech the endpoint rule heard: its own start.
    levels = [-65.0] * 80 + [-25.0] * 5
    end = len(levels) * WINDOW
    assert onset_after(levels).start(end - 14 * WINDOW, end, 0) == end - 14 * WINDOW


def onset_with_linear(windows: list[tuple[float, float]]) -> EchoOnset:
    """An EchoOnset that has observed, while the canceller suppressed, one window of each (suppressed,
    linear) level (white noise at those dBFS, fixed seed), and been asked whether it hid each."""
    onset, rng = EchoOnset(), np.random.default_rng(3)
    for suppressed, linear in windows:
        noise = rng.standard_normal(WINDOW).astype(np.float32)
        onset.observe(noise * np.float32(10 ** (suppressed / 20)), True)
        onset.hid(noise * np.float32(10 ** (linear / 20)))
    return onset


@pytest.mark.parametrize("word_linear_dbfs, bridged", [(-22.0, True), (-45.0, False)])
def test_a_hole_the_suppressor_made_after_the_first_word_is_bridged_back_to_it(word_linear_dbfs, bridged):
    # The echo alone at the suppressor's floor (-65 dBFS, -40 in the linear output), a first word it let
    # through (4 windows at -35, 30 dB over its floor), then 0.45 s of the words it hid (-90, -25 in the
    # linear output: a hole longer than ECHO_GAP_MS), then the utterance the endpoint rule began: 6 windows
    # over the floor and 5 of speech. Bridged to the first word where it is as loud in the linear output as
    # the hole; not where it is quieter (the echo alone, let through where little of it came back).
    echo, word = [(-65.0, -40.0)] * 62, [(-35.0, word_linear_dbfs)] * 4
    hole, utterance = [(-90.0, -25.0)] * 14, [(-45.0, -25.0)] * 6 + [(-25.0, -22.0)] * 5
    windows = echo + word + hole + utterance
    end = len(windows) * WINDOW
    start = end - 11 * WINDOW
    expected = len(echo) * WINDOW if bridged else end - len(utterance) * WINDOW
    assert onset_with_linear(windows).start(start, end, 0) == expected - MARGIN

