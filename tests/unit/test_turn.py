"""End of turn: Smart Turn v3.2 as loaded and batched here, the turn policy, and the test set."""

from __future__ import annotations

import asyncio
import threading
import importlib.metadata
import importlib.util

import numpy as np
import pytest

from tests.turn_set import PAUSED_EN, SAMPLE_RATE, TURNS, render
from voicebot.audio.turn import WINDOW_SAMPLES, Action, SmartTurn, TurnPolicy, last_window, model_path, with_silence
from voicebot.audio.turn_words import Cue, cue
from voicebot.config import ConfigError, load_settings
from voicebot.config.stages import EndpointConfig


@pytest.fixture(scope="module")
def smart_turn():
    model = SmartTurn()
    yield model
    model.close()


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return render(TURNS[0]).audio


def pipecat_features(audio: np.ndarray) -> np.ndarray:
    """pipecat's own feature code for Smart Turn, read from its wheel (a numpy-only file; pipecat is not imported)."""
    path = importlib.metadata.distribution("pipecat-ai").locate_file("pipecat/audio/turn/smart_turn/_whisper_features.py")
    spec = importlib.util.spec_from_file_location("pipecat_whisper_features", str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_whisper_log_mel_features(last_window(audio), do_normalize=True)


def test_model_ships_in_the_wheel_and_loads_without_pipecat():
    import sys

    path = model_path()
    assert path.name == "smart-turn-v3.2-cpu.onnx" and path.stat().st_size > 1_000_000
    assert "pipecat" not in sys.modules


def test_features_match_pipecat(smart_turn, speech):
    ours = smart_turn.features([speech])[0]
    theirs = pipecat_features(speech)
    assert ours.shape == theirs.shape == (80, 800)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_features_are_whisper_s_extractor_s_for_each_turn_of_a_batch(smart_turn, speech):
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(chunk_length=8, feature_size=80, sampling_rate=SAMPLE_RATE)
    rng = np.random.default_rng(0)
    turns = [speech, speech[: len(speech) // 3], np.tile(speech, 4),  # padded, short, longer than the window
             (0.01 * rng.standard_normal(2 * SAMPLE_RATE)).astype(np.float32)]
    ours = smart_turn.features(turns)
    for turn, features in zip(turns, ours):
        theirs = extractor([last_window(turn)], sampling_rate=SAMPLE_RATE, padding="max_length", max_length=WINDOW_SAMPLES,
                           truncation=True, do_normalize=True, return_tensors="np").input_features[0]
        np.testing.assert_allclose(features, theirs, atol=1e-5)


def test_window_is_the_last_8_s_padded_at_the_front():
    short = np.ones(SAMPLE_RATE, np.float32)
    window = last_window(short)
    assert len(window) == WINDOW_SAMPLES and not window[:-SAMPLE_RATE].any() and window[-SAMPLE_RATE:].all()
    long = np.arange(WINDOW_SAMPLES + 500, dtype=np.float32)
    np.testing.assert_array_equal(last_window(long), long[500:])


def test_a_batch_answers_as_each_alone(smart_turn, speech):
    windows = [speech, speech[: len(speech) // 2], np.concatenate([speech, np.zeros(3200, np.float32)])]
    together = smart_turn.predict(windows)
    alone = np.array([smart_turn.predict([w])[0] for w in windows])
    assert together.shape == (3,) and np.all((0 <= together) & (together <= 1))
    np.testing.assert_allclose(together, alone, atol=1e-4)


def test_waiting_questions_go_two_a_call_in_the_order_asked(speech):
    one_thread = SmartTurn(calls=1)

    async def ask_many():
        batches = one_thread.batches
        first = asyncio.create_task(one_thread.ask(speech))
        await asyncio.sleep(0.01)  # the first call is running: the next six wait for it
        rest = [asyncio.create_task(one_thread.ask(speech[: len(speech) - 800 * i])) for i in range(6)]
        answers = await asyncio.gather(first, *rest)
        return answers, one_thread.batches - batches

    try:
        answers, calls = asyncio.run(ask_many())
    finally:
        one_thread.close()
    assert len(answers) == 7 and all(0 <= a.probability <= 1 for a in answers)
    assert answers[0].queued_s < answers[1].queued_s  # the six waited for the first call
    # then went two a call, in the order asked: the later a pair, the longer it waited
    assert calls == 1 + 6 // one_thread.max_batch and one_thread.max_batch == 2
    assert answers[1].queued_s == pytest.approx(answers[2].queued_s, abs=0.005)
    assert answers[2].queued_s < answers[3].queued_s < answers[5].queued_s


def test_a_question_given_up_is_skipped(smart_turn, speech):
    async def ask_and_cancel():
        first = asyncio.create_task(smart_turn.ask(speech))
        await asyncio.sleep(0.01)
        dropped = asyncio.create_task(smart_turn.ask(speech))
        kept = asyncio.create_task(smart_turn.ask(speech[:-1600]))
        await asyncio.sleep(0)
        questions = smart_turn.questions
        dropped.cancel()
        await asyncio.gather(first, kept)
        return smart_turn.questions - questions, dropped.cancelled()

    asked, cancelled = asyncio.run(ask_and_cancel())
    assert cancelled and asked == 1


def policy(**fields) -> TurnPolicy:
    return TurnPolicy(EndpointConfig(**fields), smart=True)


def test_policy_asks_after_the_pause_and_once_at_a_time():
    turn = policy(smart_pause_ms=160, smart_early_ms=0, smart_reask_ms=320, smart_limit_ms=1500)
    assert turn.on_silence(0) is Action.NONE
    assert turn.on_silence(128) is Action.NONE
    assert turn.on_silence(160) is Action.ASK
    assert turn.on_silence(192) is Action.NONE  # the answer has not come back yet
    assert turn.on_answer(turn.question, 0.2, 224) is False
    assert turn.on_silence(256) is Action.NONE
    assert turn.on_silence(480) is Action.ASK  # the pause grew by smart_reask_ms
    assert turn.on_answer(turn.question, 0.9, 500) is True
    end = turn.end("smart", 500)
    assert (end.by, end.probability, end.pause_ms) == ("smart", 0.9, 500)


def test_policy_ends_at_the_limit_whatever_the_model_says():
    turn = policy(smart_pause_ms=160, smart_reask_ms=320, smart_limit_ms=1000)
    assert turn.on_silence(200) is Action.ASK
    turn.on_answer(turn.question, 0.1, 200)
    assert turn.on_silence(1000) is Action.END
    assert turn.end("silence", 1000).probability == 0.1


def test_a_slow_answer_does_not_ask_for_a_pause_already_past():
    # (a limit far enough that the next answer, 740 ms after its question too, comes before it)
    turn = policy(smart_pause_ms=160, smart_early_ms=0, smart_reask_ms=320, smart_limit_ms=3000)
    assert turn.on_silence(160) is Action.ASK
    turn.on_answer(turn.question, 0.1, 900)  # the answer took long: the next question at 1120, not 480
    assert turn.on_silence(1100) is Action.NONE
    assert turn.on_silence(1120) is Action.ASK


def test_no_question_whose_answer_would_come_after_the_limit():
    turn = policy(smart_pause_ms=160, smart_early_ms=0, smart_reask_ms=320, smart_limit_ms=1500)
    assert turn.on_silence(160) is Action.ASK
    turn.on_answer(turn.question, 0.1, 260)  # answered after 100 ms of silence
    for silence_ms, asked_at in ((480, 560), (800, 880), (1120, 1200)):
        assert turn.on_silence(silence_ms) is Action.ASK
        turn.on_answer(turn.question, 0.1, asked_at)
    assert turn.on_silence(1440) is Action.NONE  # its answer would come at 1520: the limit ends the turn first
    assert turn.on_silence(1500) is Action.END


def test_the_answer_time_carries_to_the_next_turn_and_follows_the_last_answer():
    turn = policy(smart_pause_ms=160, smart_early_ms=0, smart_reask_ms=320, smart_limit_ms=1500)
    assert turn.on_silence(160) is Action.ASK
    turn.on_answer(turn.question, 0.9, 1450)  # a loaded server: 1290 ms for an answer
    turn.end("smart", 1450)
    assert turn.on_silence(160) is Action.ASK  # 160 + 1290 < 1500: still worth asking
    turn.on_answer(turn.question, 0.1, 200)  # quick again
    assert turn.on_silence(480) is Action.ASK


def test_speech_again_starts_the_schedule_over_and_drops_the_stale_answer():
    turn = policy(smart_pause_ms=160, smart_early_ms=0)
    assert turn.on_silence(160) is Action.ASK
    stale = turn.question
    assert turn.on_silence(0) is Action.NONE  # the user went on
    assert turn.on_answer(stale, 0.99, 200) is False  # an answer about the earlier pause
    assert turn.on_silence(128) is Action.NONE
    assert turn.on_silence(160) is Action.ASK
    assert turn.question == stale + 1


def test_questions_waiting_together_are_answered_by_two_calls_at_once(smart_turn, speech, monkeypatch):
    """Many speakers pausing together do not queue behind one thread: the model's two calls run at
    once (each waits here until the other has started; one thread at a time would never get past)."""
    both_running = threading.Barrier(2, timeout=10)
    real_predict = smart_turn.predict

    def predict(windows):
        both_running.wait()
        return real_predict(windows)

    monkeypatch.setattr(smart_turn, "predict", predict)

    async def ask_three():
        return await asyncio.gather(*(smart_turn.ask(speech[: len(speech) - 800 * i]) for i in range(3)))

    answers = asyncio.run(ask_three())
    assert smart_turn.calls == 2 and all(0 <= a.probability <= 1 for a in answers)


def test_the_early_question_is_about_the_pause_and_its_complete_waits_for_it():
    turn = policy(smart_pause_ms=160, smart_early_ms=32, smart_reask_ms=320)
    assert turn.on_silence(32) is Action.ASK
    assert turn.asked_for_ms == 160  # its input is padded to the pause
    assert turn.on_answer(turn.question, 0.9, 96) is False  # before the pause: held
    assert turn.on_silence(128) is Action.NONE
    assert turn.on_silence(160) is Action.COMPLETE
    assert turn.end("smart", 160).probability == 0.9


def test_an_early_complete_after_the_pause_ends_the_turn_at_once():
    turn = policy(smart_pause_ms=160, smart_early_ms=32)
    assert turn.on_silence(64) is Action.ASK
    assert turn.on_silence(160) is Action.NONE  # the answer is not in: no second question
    assert turn.on_answer(turn.question, 0.9, 192) is True


def test_speech_discards_a_held_early_complete():
    turn = policy(smart_pause_ms=160, smart_early_ms=32)
    assert turn.on_silence(32) is Action.ASK
    turn.on_answer(turn.question, 0.9, 64)
    assert turn.on_silence(0) is Action.NONE  # the user went on
    assert turn.on_silence(32) is Action.ASK  # a new pause, a new early question
    assert turn.on_silence(160) is Action.NONE


def test_an_early_incomplete_stands_for_the_pause_next_question_at_the_reask():
    turn = policy(smart_pause_ms=160, smart_early_ms=32, smart_reask_ms=320)
    assert turn.on_silence(32) is Action.ASK
    assert turn.on_answer(turn.question, 0.1, 128) is False
    assert [turn.on_silence(ms) for ms in (160, 448)] == [Action.NONE] * 2
    assert turn.on_silence(480) is Action.ASK
    assert turn.asked_for_ms == 480


def test_with_silence_repeats_the_silence_heard():
    audio = np.concatenate([np.ones(10, np.float32), np.array([0.1, -0.1, 0.2], np.float32)])
    padded = with_silence(audio, 3, 8)
    assert len(padded) == len(audio) + 5
    assert padded[:13].tolist() == audio.tolist()
    assert padded[13:].tolist() == pytest.approx([0.1, -0.1, 0.2, 0.1, -0.1])
    assert with_silence(audio, 3, 3) is audio  # the pause is already heard
    assert not with_silence(np.zeros(4, np.float32), 2, 50).any()  # digital silence stays exactly that


def test_silence_rule_never_asks():
    turn = TurnPolicy(EndpointConfig(endpoint_silence_ms=500), smart=False)
    assert [turn.on_silence(ms) for ms in (160, 320, 480)] == [Action.NONE] * 3
    assert turn.on_silence(500) is Action.END


def test_config_refuses_a_pause_past_the_limit():
    with pytest.raises(ConfigError, match="smart_pause_ms"):
        load_settings(None, endpoint={"smart_pause_ms": 800, "smart_limit_ms": 600})
    with pytest.raises(ConfigError, match="smart_early_ms"):
        load_settings(None, endpoint={"smart_pause_ms": 160, "smart_early_ms": 160})
    assert load_settings(None).endpoint.turn == "smart"


def test_turn_set_sizes_and_languages():
    paused = [t for t in TURNS if t.paused]
    complete = [t for t in TURNS if not t.paused]
    assert len(paused) >= 40 and len(complete) >= 40
    assert {t.language for t in paused} == {t.language for t in complete} == {"en", "zh"}
    assert all(300 <= p <= 900 for t in paused for p in t.pauses_ms)
    assert len({t.name for t in TURNS}) == len(TURNS)


def test_a_rendered_turn_knows_its_pauses_and_its_end():
    item = next(t for t in TURNS if t.parts == PAUSED_EN[2])  # three parts, two pauses
    turn = render(item)
    assert turn.end_s == pytest.approx(len(turn.audio) / SAMPLE_RATE)
    assert len(turn.pauses) == 2
    for (start, end), ms in zip(turn.pauses, item.pauses_ms):
        assert end - start == pytest.approx(ms / 1000, abs=1e-3)
        inside = turn.audio[int(start * SAMPLE_RATE) : int(end * SAMPLE_RATE)]
        assert not inside.any()
        before = turn.audio[int(start * SAMPLE_RATE) - 1600 : int(start * SAMPLE_RATE)]
        assert np.abs(before).max() > 0.05  # speech right up to the pause
    assert np.abs(turn.audio[-1600:]).max() > 0.05  # and up to the end: end_s is where the user stopped


def test_the_threshold_falls_with_the_silence_to_the_floor_at_the_limit():
    turn = policy(smart_pause_ms=200, smart_limit_ms=1200, smart_threshold=0.9, smart_threshold_floor=0.4)
    assert [round(turn.threshold(ms), 3) for ms in (100, 200, 700, 1200, 2000)] == [0.9, 0.9, 0.65, 0.4, 0.4]
    assert turn.on_silence(200) is Action.ASK
    assert turn.on_answer(turn.question, 0.6, 280) is False  # about 200 ms: needs 0.9
    assert turn.on_silence(840) is Action.ASK  # the re-ask, about 840 ms: needs 0.58
    assert turn.on_answer(turn.question, 0.6, 900) is True


def test_words_that_hold_withdraw_a_complete_and_words_that_go_make_one():
    turn = policy(smart_pause_ms=160, smart_threshold=0.8, smart_threshold_floor=0.8, smart_words_hold=3.0,
                  smart_words_go=2.0)
    assert turn.on_silence(160) is Action.ASK
    assert turn.on_answer(turn.question, 0.9, 240) is True  # no transcript yet: the answer alone
    assert turn.on_text("I would like to", 250) is False  # ... which the words withdraw
    assert turn.on_text("I would like pizza", 260) is True  # (a transcript with no cue leaves it)
    assert turn.on_silence(0) is Action.NONE and turn.cue is Cue.NONE  # the user went on
    assert turn.on_silence(160) is Action.ASK
    assert turn.on_answer(turn.question, 0.5, 240) is False
    assert turn.on_text("你今年多大了吗", 250) is True  # a question particle: 0.5 -> 0.88


def test_no_words_weight_means_the_words_change_nothing():
    turn = policy(smart_pause_ms=160, smart_threshold=0.8, smart_threshold_floor=0.8, smart_words_hold=0.0,
                  smart_words_go=0.0)
    assert turn.on_silence(160) is Action.ASK
    assert turn.on_answer(turn.question, 0.9, 240) is True
    assert turn.on_text("we need eggs and", 250) is True


def test_a_transcript_while_a_question_is_out_waits_for_its_answer():
    turn = policy(smart_pause_ms=160, smart_words_go=2.0)
    assert turn.on_silence(160) is Action.ASK
    assert turn.on_text("你好吗", 200) is False
    assert turn.on_answer(turn.question, 0.7, 240) is True  # 0.7 -> 0.95 with the particle


@pytest.mark.parametrize(("text", "expected"), [
    ("I would like to", Cue.HOLD), ("we need eggs, milk and", Cue.HOLD), ("um", Cue.HOLD), ("the answer is", Cue.HOLD),
    ("I think so", Cue.NONE), ("thank you", Cue.NONE), ("turn it on", Cue.NONE), ("order a pizza", Cue.NONE),
    ("I would like to,", Cue.HOLD), ("Is it raining?", Cue.GO), ("Order a pizza.", Cue.GO),
    ("我最喜欢的游戏是", Cue.HOLD), ("我想要", Cue.NONE), ("你今年多大了吗", Cue.GO), ("我们走吧", Cue.GO),
    ("还有面包。", Cue.GO), ("我需要鸡蛋，", Cue.HOLD), ("首先 打开灯 然后", Cue.HOLD), ("", Cue.NONE),
])
def test_the_words_cue(text, expected):
    assert cue(text) is expected


def test_config_refuses_a_floor_above_the_threshold():
    with pytest.raises(ConfigError, match="smart_threshold_floor"):
        load_settings(None, endpoint={"smart_threshold": 0.5, "smart_threshold_floor": 0.6})
