"""The endpoint rule: where speech ends and when the utterance does, on given probabilities
(the rule alone) and on Silero's own over espeak speech (the model's hangover)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.turn_set import TURNS, render
from voicebot.audio.endpoint import HANGOVER_WINDOWS_MAX, HELD_SILENCE_SHARE, WINDOW, WINDOW_MS, Endpointer, EventKind
from voicebot.audio.rates import LISTEN_RATE
from voicebot.config.stages import EndpointConfig
from voicebot.serving.silero import SAMPLE_RATE

ROOM = 10 ** (-60 / 20)  # a quiet room's noise, RMS
SPEECH = 10 ** (-25 / 20)


def windows(*runs: tuple[int, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """(count, RMS, Silero's probability) runs of windows of white noise at that level."""
    rng = np.random.default_rng(0)
    audio = [rng.standard_normal((n, WINDOW)).astype(np.float32) * rms for n, rms, _ in runs]
    probabilities = [np.full(n, p, np.float32) for n, _, p in runs]
    return np.concatenate(audio), np.concatenate(probabilities)


def ends(config: EndpointConfig, audio: np.ndarray, probabilities: np.ndarray) -> list[tuple[int, int]]:
    """(speech end sample, sample where the end was decided) of each utterance."""
    endpointer = Endpointer(config)
    out = []
    for i in range(len(audio)):
        for event in endpointer.decide(audio[i : i + 1], probabilities[i : i + 1]):
            if event.kind is EventKind.END:
                out.append((event.speech_end_sample, endpointer.samples_seen))
    return out


CONFIG = EndpointConfig(endpoint_silence_ms=160)
PAUSE = round(160 / WINDOW_MS)  # windows


def test_a_hangover_no_louder_than_the_room_counts_as_silence():
    # Silero still says speech for two windows of room noise after the last word.
    audio, p = windows((10, ROOM, 0.1), (20, SPEECH, 1.0), (2, ROOM, 0.8), (20, ROOM, 0.05))
    assert ends(CONFIG, audio, p) == [(30 * WINDOW, (30 + PAUSE) * WINDOW)]


def test_a_loud_window_is_speech_whatever_follows():
    audio, p = windows((10, ROOM, 0.1), (20, SPEECH, 1.0), (2, SPEECH / 10, 0.8), (20, ROOM, 0.05))
    assert ends(CONFIG, audio, p) == [(32 * WINDOW, (32 + PAUSE) * WINDOW)]


def test_no_more_than_the_hangover_is_taken_back():
    # Soft speech at the room's level that Silero hears: it may be speech, so at most
    # HANGOVER_WINDOWS_MAX windows of it count as silence.
    audio, p = windows((10, ROOM, 0.1), (20, SPEECH, 1.0), (8, ROOM, 0.9), (20, ROOM, 0.05))
    speech_end = (38 - HANGOVER_WINDOWS_MAX) * WINDOW
    assert ends(CONFIG, audio, p) == [(speech_end, speech_end + PAUSE * WINDOW)]


def test_a_dip_inside_speech_does_not_end_the_utterance():
    # A quiet stretch Silero calls speech, then one it does not, then speech again: shorter than
    # the pause even with the quiet windows counted as silence, so one utterance.
    dip = PAUSE - HANGOVER_WINDOWS_MAX - 1
    audio, p = windows((10, ROOM, 0.1), (20, SPEECH, 1.0), (HANGOVER_WINDOWS_MAX, ROOM, 0.8), (dip, ROOM, 0.1),
                       (20, SPEECH, 1.0), (20, ROOM, 0.05))
    last_word = (30 + HANGOVER_WINDOWS_MAX + dip + 20) * WINDOW
    assert ends(CONFIG, audio, p) == [(last_word, last_word + PAUSE * WINDOW)]


def test_with_no_room_heard_yet_nothing_is_taken_back():
    audio, p = windows((20, SPEECH, 1.0), (2, ROOM, 0.8), (20, ROOM, 0.05))
    assert ends(CONFIG, audio, p) == [(22 * WINDOW, (22 + PAUSE) * WINDOW)]


@pytest.mark.parametrize("noise_dbfs", [None, -60])
def test_silero_speech_ends_within_a_window_of_the_true_end(noise_dbfs):
    """Silero's own probabilities on espeak turns: the speech end the endpointer reports lies on
    the window grid, so it is within one window of the turn's true end at the median and never a
    hangover window more than that (before: 53 ms late at the median, 87 ms at p95, 107 at most
    over tests/turn_set.py)."""
    rng = np.random.default_rng(1)
    lags = []
    for item in [t for t in TURNS if not t.pauses_ms][::4]:
        turn = render(item)
        lead = 16000 * 4 // 10
        audio = np.concatenate([np.zeros(lead, np.float32), turn.audio, np.zeros(16000, np.float32)])
        if noise_dbfs is not None:
            audio += rng.standard_normal(len(audio)).astype(np.float32) * 10 ** (noise_dbfs / 20)
        events = Endpointer(EndpointConfig(endpoint_silence_ms=500)).process(audio)
        end = [e for e in events if e.kind is EventKind.END]
        assert end, item.name
        lags.append((end[-1].speech_end_sample - (lead + turn.end_s * 16000)) / 16)
    assert len(lags) >= 8
    assert abs(np.percentile(lags, 50)) < WINDOW_MS and max(lags) < 2 * WINDOW_MS, lags


def test_the_endpointer_hears_at_silero_s_rate():
    """Silero's graph (serving/silero.py) takes 16 kHz: the rate the server listens at."""
    assert SAMPLE_RATE == LISTEN_RATE


def run_hidden(config: EndpointConfig, audio: np.ndarray, probabilities: np.ndarray, hidden: np.ndarray):
    """Each event with the stream position after its window, and the longest speech run the barge-in rule read."""
    endpointer = Endpointer(config)
    events, longest_run = [], 0.0
    for i in range(len(audio)):
        for event in endpointer.decide(audio[i : i + 1], probabilities[i : i + 1], hidden[i : i + 1]):
            events.append((event, endpointer.samples_seen))
        longest_run = max(longest_run, endpointer.speech_run_ms)
    return events, longest_run


def hidden_runs(*runs: tuple[int, bool]) -> np.ndarray:
    return np.concatenate([np.full(n, flag) for n, flag in runs])


FLOOR = 10 ** (-90 / 20)  # AEC3's suppressor's floor
HELD = int(CONFIG.endpoint_silence_ms * HELD_SILENCE_SHARE // WINDOW_MS)  # windows one pause may hold


def test_silence_the_echo_canceller_hid_inside_an_utterance_is_not_the_users():
    # Issue 29: the suppressor took longer than the pause from inside words said over the echo. Its
    # windows count as neither speech nor silence: one utterance, ended by the silence after the words.
    hole = PAUSE + HELD - 1
    audio, p = windows((10, ROOM, 0.1), (20, SPEECH, 1.0), (hole, FLOOR, 0.05), (20, SPEECH, 1.0), (20, ROOM, 0.05))
    hidden = hidden_runs((30, False), (hole, True), (40, False))
    assert ends(CONFIG, audio, p) == [(30 * WINDOW, (30 + PAUSE) * WINDOW), (last := (50 + hole) * WINDOW, last + PAUSE * WINDOW)]
    events, _ = run_hidden(CONFIG, audio, p, hidden)
    assert [(e.kind, at) for e, at in events if e.kind is not EventKind.AUDIO] == [
        (EventKind.START, 15 * WINDOW), (EventKind.END, last + PAUSE * WINDOW)]
    assert events[-1][0].speech_end_sample == last and events[-1][0].held_ms == 0  # the end not late: speech after the hole


def test_at_most_a_share_of_the_pause_is_held_and_the_end_says_how_much():
    # After the words, the echo alone is hidden just as well (the canceller cannot tell them apart):
    # the end comes HELD windows late, and says so; the barge-in rule's speech run is Silero's alone.
    assert HELD >= 1
    audio, p = windows((10, ROOM, 0.1), (20, SPEECH, 1.0), (60, FLOOR, 0.05))
    events, longest_run = run_hidden(CONFIG, audio, p, hidden_runs((30, False), (60, True)))
    end, at = events[-1]
    assert end.kind is EventKind.END and end.speech_end_sample == 30 * WINDOW
    assert end.held_ms == HELD * WINDOW_MS <= CONFIG.endpoint_silence_ms * HELD_SILENCE_SHARE
    assert at == (30 + PAUSE + HELD) * WINDOW
    assert longest_run == 20 * WINDOW_MS


def test_each_pause_holds_anew():
    # Two holes, each longer than the pause and within what a pause may hold: the first does not use up the second's.
    hole = PAUSE + HELD - 1
    audio, p = windows((20, SPEECH, 1.0), (hole, FLOOR, 0.05), (10, SPEECH, 1.0), (hole, FLOOR, 0.05), (10, SPEECH, 1.0),
                       (20, ROOM, 0.05))
    hidden = hidden_runs((20, False), (hole, True), (10, False), (hole, True), (30, False))
    events, _ = run_hidden(CONFIG, audio, p, hidden)
    assert [e.kind for e, _ in events if e.kind is not EventKind.AUDIO] == [EventKind.START, EventKind.END]


def test_hidden_windows_outside_an_utterance_change_nothing():
    # Before an utterance starts (and before min_speech_ms of speech), the echo alone is hidden:
    # it must neither start nor hold anything.
    audio, p = windows((30, FLOOR, 0.05), (2, SPEECH, 1.0), (30, FLOOR, 0.05), (20, SPEECH, 1.0), (20, ROOM, 0.05))
    hidden = hidden_runs((62, True), (40, False))
    plain, _ = run_hidden(CONFIG, audio, p, np.zeros(len(p), bool))
    held, _ = run_hidden(CONFIG, audio, p, hidden)
    assert [(e.kind, at, e.speech_end_sample) for e, at in held] == [(e.kind, at, e.speech_end_sample) for e, at in plain]


def test_the_silence_a_turn_policy_reads_leaves_out_the_held_windows():
    endpointer = Endpointer(CONFIG)
    audio, p = windows((20, SPEECH, 1.0), (HELD, FLOOR, 0.05), (2, ROOM, 0.05))
    endpointer.decide(audio, p, hidden_runs((20, False), (HELD, True), (2, False)))
    assert endpointer.in_utterance and endpointer.silence_ms == 2 * WINDOW_MS
