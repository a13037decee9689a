"""A render call's bound in audio (voicebot/serving/render_queue.py AudioBudget): a call's chunks ×
its longest chunk's seconds (padded, a bucketed render) or their sum (packed, an eager one) stay
within the budget, so a reply's short first chunk is not padded to other replies' long chunks; a
chunk the budget leaves goes first in the next call; every chunk is rendered once and the
deferrals are counted."""

from __future__ import annotations

import concurrent.futures
import random

import numpy as np
import pytest

from voicebot.serving.render_queue import AudioBudget, RenderQueue
from voicebot.serving.scheduler_requests import Render
from voicebot.serving.step_costs import StepCosts

RATE = 24000
FIRST_S, LONGEST_S = 2.08, 4.12  # a first chunk, the longest chunk (token2wav.py render_budget)
BUDGET = AudioBudget(lambda seconds: seconds, 8 * FIRST_S, LONGEST_S, padded=True)  # a chunk here is its seconds
PACKED = AudioBudget(lambda seconds: seconds, 8 * FIRST_S, LONGEST_S, padded=False)


def _queue(calls: list[list[float]], answers: dict, budget: AudioBudget | None = BUDGET) -> RenderQueue:
    def render(chunks: list[float]) -> list[np.ndarray]:
        calls.append(list(chunks))
        return [np.zeros(round(seconds * RATE), np.float32) for seconds in chunks]

    def answer(request, result=None, exc=None):
        assert id(request) not in answers, "a render answered twice"
        answers[id(request)] = (request.chunk, result, exc)

    return RenderQueue("test", render, StepCosts(), answer, lambda exc: exc, max_batch=8, hold_steps=2,
                       sample_rate=RATE, budget=budget)


def _submit(queue: RenderQueue, seconds: list[float]) -> list[Render]:
    requests = []
    for i, s in enumerate(seconds):  # deadlines in list order: the first is the most urgent
        request = Render(deadline=float(i), chunk=s)
        request.future = concurrent.futures.Future()
        requests.append(request)
    queue.waiting += requests
    return requests


def test_a_long_chunk_waits_for_the_next_call_instead_of_padding_the_first_chunks() -> None:
    """Seven replies' first chunks (2 s) and one long chunk (4.12 s) among them: the first call
    takes the seven (7 × 2 = 14 s, not 8 × 4.12 = 33 s of padded audio), the long one goes alone
    next, counted once; every chunk gets its whole audio."""
    calls, answers = [], {}
    queue = _queue(calls, answers)
    requests = _submit(queue, [2.0] * 4 + [LONGEST_S] + [2.0] * 3)
    queue.step([])
    queue.step([])
    assert calls == [[2.0] * 7, [LONGEST_S]]
    assert queue.budget_deferrals == 1 and not queue.waiting
    for r in requests:
        chunk, audio, exc = answers[id(r)]
        assert exc is None and len(audio) == round(chunk * RATE)


def test_without_a_budget_the_same_chunks_go_in_one_call() -> None:
    """The contrast: bounded by max_batch alone, the long chunk joins the first chunks' call."""
    calls, answers = [], {}
    queue = _queue(calls, answers, budget=None)
    _submit(queue, [2.0] * 4 + [LONGEST_S] + [2.0] * 3)
    queue.step([])
    assert calls == [[2.0] * 4 + [LONGEST_S] + [2.0] * 3] and queue.budget_deferrals == 0


def test_packed_the_sum_is_bounded() -> None:
    """An eager call packs its chunks: the same chunks, 18.1 s in all, go as 7 (16.1 s) and 1."""
    calls, answers = [], {}
    queue = _queue(calls, answers, budget=PACKED)
    _submit(queue, [2.0] * 4 + [LONGEST_S] + [2.0] * 3)
    queue.step([])
    queue.step([])
    assert calls == [[2.0] * 4 + [LONGEST_S] + [2.0] * 2, [2.0]] and queue.budget_deferrals == 1


@pytest.mark.parametrize("budget", [BUDGET, PACKED], ids=["padded", "packed"])
def test_every_call_stays_within_its_budget_and_every_chunk_renders_once(budget: AudioBudget) -> None:
    """Random chunk lengths (0.5 s to the longest) arriving over time: each call's audio ≤ the
    budget (a call of one chunk always goes), none lost, none rendered twice."""
    rng = random.Random(3)
    calls, answers = [], {}
    queue = _queue(calls, answers, budget)
    submitted = []
    for _ in range(40):
        submitted += _submit(queue, [rng.uniform(0.5, LONGEST_S) for _ in range(rng.randint(0, 12))])
        queue.step([])
    while queue.waiting:
        queue.step([])
    for chunks in calls:
        assert len(chunks) <= 8 and (len(chunks) == 1 or budget.call_s(chunks) <= budget.max_call_s), chunks
    assert sorted(c for call in calls for c in call) == sorted(r.chunk for r in submitted)
    assert len(answers) == len(submitted) and queue.budget_deferrals > 0


def test_a_budget_must_hold_the_longest_chunk() -> None:
    with pytest.raises(ValueError, match="would not hold the longest chunk"):
        AudioBudget(lambda seconds: seconds, 4.0, LONGEST_S, padded=True)
