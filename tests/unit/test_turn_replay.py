"""bench/turn_offline.py's replay: the product's TurnPolicy driven over recorded answers as the
session drives it, and the eot-bench axes read off its points.

The replay's curves only mean something if its decisions are the live policy's: the replay
holds no policy of its own (it calls voicebot/audio/turn.py's TurnPolicy window by window), so
these tests pin the session's side of it: when answers and the transcript come in, that a
"complete" waits for the transcript, when the user is heard again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from voicebot.config.stages import EndpointConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import turn_offline  # noqa: E402
from turn_offline import Boundary, Point, decide  # noqa: E402

HANGOVER, MODEL, TEXT = 32, 80, 64


def end(answer, text: str = "hello there") -> Boundary:
    return Boundary("t", 0, "en", True, float("inf"), text, {ms: answer(ms) for ms in turn_offline.GRID_MS})


def pause(length_ms: float, answer, text: str = "I would like") -> Boundary:
    return Boundary("t", 0, "en", False, length_ms, text,
                    {ms: answer(ms) for ms in turn_offline.GRID_MS if ms + HANGOVER < length_ms - turn_offline.WINDOW_MS})


def at(config: EndpointConfig, b: Boundary, **timing) -> float | None:
    return decide(config, b, **{"hangover_ms": HANGOVER, "model_ms": MODEL, "text_ms": TEXT, **timing}).at_ms


def test_a_complete_first_answer_ends_the_turn_when_it_comes_back():
    config = EndpointConfig(smart_pause_ms=192, smart_threshold=0.8, smart_threshold_floor=0.8)
    assert at(config, end(lambda ms: 0.9)) == 192 + MODEL + HANGOVER


def test_a_complete_before_the_transcript_waits_for_it():
    config = EndpointConfig(smart_pause_ms=192)
    assert at(config, end(lambda ms: 0.9), text_ms=150) == 192 + 150 + HANGOVER


def test_the_silence_rule_ends_on_the_first_window_past_its_wait():
    assert at(EndpointConfig(turn="silence", endpoint_silence_ms=500), end(lambda ms: 0.0)) == 512 + HANGOVER


def test_re_asks_follow_the_policy_until_the_timeout():
    config = EndpointConfig(smart_pause_ms=192, smart_reask_ms=320, smart_threshold=0.8, smart_threshold_floor=0.8,
                            smart_limit_ms=1504)
    # "complete" from 800 ms on: asked at 192, 512, 832 -> decided when 832's answer is back
    assert at(config, end(lambda ms: 0.9 if ms >= 800 else 0.1)) == 832 + MODEL + HANGOVER
    b = end(lambda ms: 0.1)
    assert at(config, b) == 1504 + HANGOVER
    assert decide(config, b).questions == 4  # 192, 512, 832, 1152; 1472 would answer after the timeout


def test_a_falling_threshold_ends_the_long_tail_sooner():
    flat = EndpointConfig(smart_pause_ms=192, smart_reask_ms=160, smart_threshold=0.8, smart_threshold_floor=0.8,
                          smart_limit_ms=1500)
    falling = flat.model_copy(update={"smart_threshold_floor": 0.3})
    b = end(lambda ms: 0.5)  # a model that stays unsure at the true end
    assert at(flat, b) == 1500 + 4 + HANGOVER  # the timeout, on the window grid
    assert at(falling, b) < 1200


def test_a_pause_is_cut_off_only_by_an_answer_before_the_user_is_heard_again():
    config = EndpointConfig(smart_pause_ms=192)
    assert at(config, pause(600, lambda ms: 0.9)) == 192 + MODEL + HANGOVER
    assert at(config, pause(300, lambda ms: 0.9)) is None  # answer due at 272 + 32: the user is back at 300
    assert at(config, pause(600, lambda ms: 0.1)) is None


def test_hold_words_withdraw_a_complete_and_go_words_make_one():
    hold = EndpointConfig(smart_pause_ms=192, smart_words_hold=3.0)
    assert at(hold, pause(600, lambda ms: 0.9, "I would like to")) is None
    assert at(hold, pause(600, lambda ms: 0.9, "I would like pizza")) is not None
    go = EndpointConfig(smart_pause_ms=192, smart_threshold=0.8, smart_threshold_floor=0.8, smart_words_go=2.0)
    zh = Boundary("t", 0, "zh", True, float("inf"), "你今年多大了吗", {ms: 0.5 for ms in turn_offline.GRID_MS})
    assert at(go, zh) == 192 + MODEL + HANGOVER  # the transcript came first: the answer is weighed with it
    assert at(go, zh, text_ms=150) == 192 + 150 + HANGOVER  # "incomplete" alone; the particle makes it "complete"


def test_a_question_past_the_recorded_answers_is_an_error_not_a_guess():
    b = Boundary("t", 0, "en", True, float("inf"), "hi", {ms: 0.1 for ms in turn_offline.GRID_MS if ms < 800})
    with pytest.raises(KeyError, match="GRID_MS"):
        decide(EndpointConfig(smart_reask_ms=96, smart_limit_ms=1500), b)


def point(cut: float, mean_ms: float) -> Point:
    return Point(cut, mean_ms, mean_ms, 1.0, 40)


def test_the_frontier_and_the_budgets():
    points = {"a": point(0.30, 250), "b": point(0.20, 400), "c": point(0.25, 450), "d": point(0.05, 700),
              "e": point(0.10, 590)}
    assert turn_offline.frontier(points) == ["a", "b", "e", "d"]  # c: b is faster with fewer cut-offs
    assert turn_offline.at_latency(points, 300) == "a"
    assert turn_offline.at_latency(points, 600) == "e"
    assert turn_offline.at_latency(points, 200) is None
    assert turn_offline.at_cut(points, 0.10) == "e"
    assert turn_offline.at_cut(points, 0.05) == "d"
    assert turn_offline.at_cut(points, 0.01) is None
