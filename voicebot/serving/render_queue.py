"""The device scheduler's renders (voicebot/serving/scheduler.py): the ones waiting, earliest
deadline first, and the one call running on the device.

The most urgent renders, at most `max_batch` of them, go in one `render` call (one flow call and
one vocoder call for all of them: Token2Wav.render), and, with an `AudioBudget`, at most its
`max_call_s` seconds of audio as the call computes it: padded, its chunks × its longest chunk's
seconds (a bucketed call pads every stream to the longest), else their sum (an eager call packs
them). So a call that carries a new reply's short first chunk cannot also carry long chunks of
other replies that would make it cost more than the budget: a chunk that would take the call past
it waits, first in line, for the next call (counted in `budget_deferrals`; none is dropped), and a
call always takes its most urgent chunk, whatever its length (a budget holds the longest chunk). A render may answer with a `Rendering` still
running on the device (CUDA: the model's side stream): the LM steps go on while it runs, its
requests are answered once it is done, and the next render starts after it. Sessions reach their
chunk boundaries at different steps, so a render whose listener still has audio to spare (more than
twice the last render call's cost plus RENDER_MARGIN_S) waits while a more urgent row decodes, and
up to `hold_steps` LM steps for others to join it; a new reply's first chunk never waits.

Thread-only: the scheduler's thread owns it; it answers its requests with the scheduler's `answer`
(which resolves them on their loops) and `aborted` (what a request a BaseException ended gets).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from voicebot.serving.model_interfaces import Rendering, as_rendering
from voicebot.serving.scheduler_requests import Decode, Render
from voicebot.serving.step_costs import StepCosts

log = logging.getLogger(__name__)

RENDER_MARGIN_S = 0.1  # slack a held render keeps beyond twice the render cost


@dataclass(frozen=True)
class AudioBudget:
    """A render call's bound in seconds of audio: `seconds_of(chunk)`, the audio a chunk computes,
    at most `longest_chunk_s`; `max_call_s`, the most a call computes: `padded`, its chunks × its
    longest chunk's seconds, else their sum (`call_s`)."""

    seconds_of: Callable[[Any], float]
    max_call_s: float
    longest_chunk_s: float
    padded: bool

    def call_s(self, seconds: list[float]) -> float:
        return len(seconds) * max(seconds, default=0.0) if self.padded else sum(seconds)

    def __post_init__(self) -> None:
        if self.max_call_s < self.longest_chunk_s:
            raise ValueError(f"a render call's budget of {self.max_call_s:g} s of audio would not hold "
                             f"the longest chunk ({self.longest_chunk_s:g} s)")


@dataclass(eq=False)
class _InFlight:
    batch: list[Render]
    rendering: Rendering
    started: float  # time.perf_counter() at its launch


class RenderQueue:
    def __init__(self, name: str, render: Callable[[list[Any]], list[np.ndarray] | Rendering], costs: StepCosts,
                 answer: Callable[..., None], aborted: Callable[[BaseException], Exception], *,
                 max_batch: int, hold_steps: int, sample_rate: int, budget: AudioBudget | None = None) -> None:
        """`render(chunks)`: the audio (24 kHz float32) of several sessions' chunks, in one call,
        or a `Rendering` of it still running on the device; `budget`: a call's bound in audio
        (None: max_batch chunks, whatever their length)."""
        self.name, self.render, self.costs = name, render, costs
        self._answer, self._aborted = answer, aborted
        self.max_batch, self.hold_steps, self.sample_rate = max_batch, hold_steps, sample_rate
        self.budget = budget
        self.sizes: Counter[int] = Counter()  # render calls, by chunks in the call
        self.budget_deferrals = 0  # chunks a call left to the next one by its audio budget
        self.deadline_misses = 0  # renders done after a listener that had audio ran out
        self.waiting: list[Render] = []
        self.in_flight: _InFlight | None = None  # at most one render running on the device

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.in_flight)

    def clear(self) -> None:
        """Forget every render (the scheduler has failed their requests)."""
        self.waiting, self.in_flight = [], None

    def step(self, decoding: Collection[Decode]) -> None:
        """The render on the device, answered once done (waited for when no LM row of `decoding`
        could step meanwhile); then, none in flight, the most urgent renders in one call, answered
        with their audio when it comes back rendered, else left in flight."""
        if self.in_flight is not None:
            if not (self.in_flight.rendering.ready() or not any(request.row.waiting for request in decoding)):
                return
            in_flight, self.in_flight = self.in_flight, None
            self._finish(in_flight)
        self.waiting.sort(key=lambda r: r.deadline)
        if self.waiting and self._may_hold(self.waiting[0], decoding):
            for request in self.waiting:
                request.held += 1
            return
        batch, deferred = self._take()
        self.waiting[:0] = deferred  # first in line for the next call, in deadline order
        if not batch:
            return
        start = time.perf_counter()
        try:
            rendered = self.render([r.chunk for r in batch])
        except BaseException as exc:  # fails only this call's renders
            self._failed(batch, exc)
            return
        in_flight = _InFlight(batch, as_rendering(rendered), start)
        if isinstance(rendered, Rendering):
            self.in_flight = in_flight
        else:
            self._finish(in_flight)

    def _take(self) -> tuple[list[Render], list[Render]]:
        """Of the max_batch most urgent renders, those within the audio budget (the most urgent one
        whatever its length): the next call's; and the ones the budget left, to go first next time."""
        batch: list[Render] = []
        deferred: list[Render] = []
        seconds: list[float] = []  # the batch's chunks' audio
        while self.waiting and len(batch) + len(deferred) < self.max_batch:
            request = self.waiting.pop(0)
            if request.future.cancelled():  # its session stopped waiting (barge-in, disconnect)
                self._answer(request, None)
                continue
            if self.budget is not None:
                more = seconds + [self.budget.seconds_of(request.chunk)]
                if batch and self.budget.call_s(more) > self.budget.max_call_s:
                    deferred.append(request)
                    self.budget_deferrals += 1
                    continue
                seconds = more
            batch.append(request)
        return batch, deferred

    def _finish(self, in_flight: _InFlight) -> None:
        """Answer a render's requests with its audio (waiting for the device if it is still busy).
        Its cost is from its launch until now: with LM steps run meanwhile, an upper bound."""
        batch = in_flight.batch
        try:
            audio = in_flight.rendering.audio()
        except BaseException as exc:  # fails only this call's renders
            self._failed(batch, exc)
            return
        self.costs.add_render(time.perf_counter() - in_flight.started, sum(map(len, audio)) / self.sample_rate)
        self.sizes[len(batch)] += 1
        done = time.monotonic()
        for request, samples in zip(batch, audio, strict=True):
            if request.submitted < request.deadline < done:
                self.deadline_misses += 1
            self._answer(request, samples)

    def _failed(self, batch: list[Render], exc: BaseException) -> None:
        log.error("scheduler %s: render failed", self.name, exc_info=exc)
        error = self._aborted(exc)
        for request in batch:
            self._answer(request, exc=error)

    def _may_hold(self, urgent: Render, decoding: Collection[Decode]) -> bool:
        """Hold the renders one more step, if the most urgent one's listener has audio to spare and
        the batch has room: while a decoding row is more urgent still (earliest deadline first
        across kinds: a new reply's first chunk is not kept waiting behind others' renders), or for
        up to hold_steps steps while others decode towards a chunk of their own."""
        if not decoding or len(self.waiting) >= self.max_batch:
            return False
        if urgent.deadline - time.monotonic() <= 2 * (self.costs.render_call or 0.0) + RENDER_MARGIN_S:
            return False
        if min(request.deadline for request in decoding) < urgent.deadline:
            return True
        return urgent.held < self.hold_steps
