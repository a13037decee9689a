"""bench/turn_offline.py's replay decides a turn's end when the product's TurnPolicy does.

The replay's tables (bench/smart_turn.py --replay) only mean something if its schedule (the early
question, a "complete" held until the pause, the re-asks) is TurnPolicy's: here both run on the
same answers, in VAD silence with no hangover, the policy fed 32 ms windows and each answer
`model_ms` after its question.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from voicebot.audio.turn import TurnPolicy
from voicebot.config import EndpointConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import turn_offline  # noqa: E402

WINDOW_MS = turn_offline.WINDOW_MS


def product_decides(config: EndpointConfig, p: dict[int, float], model_ms: int) -> float:
    """VAD silence (ms) at which TurnPolicy ends a turn whose every window stays silent."""
    policy = TurnPolicy(config, smart=True)
    out: tuple[float, int, float] | None = None  # (answered at, question, probability)
    ticks = range(WINDOW_MS, config.smart_limit_ms + 2 * WINDOW_MS, WINDOW_MS)
    for silence in ticks:
        if out is not None and out[0] <= silence:
            answered, question, probability = out
            out = None
            if policy.on_answer(question, probability, answered):
                return answered
        action = policy.on_silence(silence)
        if action.name in ("COMPLETE", "END"):
            return min(silence, config.smart_limit_ms)
        if action.name == "ASK":
            out = (silence + model_ms, policy.question, p[turn_offline._on_grid(policy.asked_for_ms)])
    raise AssertionError("the policy never ended the turn")


@pytest.mark.parametrize(("early_ms", "pause_ms", "threshold", "model_ms"),
                         list(itertools.product((0, 32), (160, 192), (0.5, 0.8), (22, 80, 150))))
def test_replay_ends_a_turn_when_the_policy_does(early_ms, pause_ms, threshold, model_ms):
    config = EndpointConfig(smart_early_ms=early_ms, smart_pause_ms=pause_ms, smart_threshold=threshold)
    answers = {  # the model's answer by the silence asked about: complete at once, later, or never
        "at once": lambda ms: 0.9,
        "after 500 ms": lambda ms: 0.9 if ms >= 500 else 0.6,
        "never": lambda ms: 0.1,
    }
    for name, answer in answers.items():
        p = {ms: answer(ms) for ms in range(WINDOW_MS, 2048, WINDOW_MS)}  # past the limit: every question answered
        boundary = turn_offline.Boundary("t", 0, "en", True, float("inf"), p)
        replay = turn_offline.Policy("p", pause_ms, config.smart_reask_ms, threshold, config.smart_limit_ms, early_ms)
        assert replay.decide(boundary, 0, model_ms) == product_decides(config, p, model_ms), name


def test_answers_asked_chain_by_chain_decide_as_all_of_them(tmp_path, monkeypatch):
    """bench/smart_turn.py --replay asks each pause's chain only up to an answer of `stop_at` (the
    grid's top threshold): every policy of EARLY_GRID decides each boundary as with every answer."""
    import tempfile

    import numpy as np

    from tests.turn_set import RenderedTurn, TurnItem

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the answers' disk cache

    class Model:  # an answer that jumps about with the silence heard, the same for the same window
        path = Path(__file__)
        calls = 0

        def predict(self, windows):
            self.calls += len(windows)
            return np.array([np.random.default_rng(len(w)).random() for w in windows])

    rng = np.random.default_rng(0)
    speech = rng.standard_normal(16000).astype(np.float32) * 0.1
    rendered = [RenderedTurn(TurnItem("en-complete-00", "en", ("a.",), ()), speech, 1.0, ()),
                RenderedTurn(TurnItem("en-paused-00", "en", ("a,", "b."), (700,)),
                             np.concatenate([speech, np.zeros(11200, np.float32), speech]), 2.7, ((1.0, 1.7),))]
    chains = turn_offline.asked_chains(320, 1500)
    stop_at = max(threshold for _, threshold, _ in turn_offline.EARLY_GRID)
    every, stopped = Model(), Model()
    full = turn_offline.boundaries(rendered, every, 32, chains)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "again"))
    part = turn_offline.boundaries(rendered, stopped, 32, chains, stop_at)
    assert stopped.calls < every.calls
    for early, threshold, pause in turn_offline.EARLY_GRID:
        policy = turn_offline.Policy("p", pause, 320, threshold, 1500, early)
        for model_ms in (22, 80, 150, 250):
            assert [policy.decide(b, 32, model_ms) for b in part] == [policy.decide(b, 32, model_ms) for b in full]
