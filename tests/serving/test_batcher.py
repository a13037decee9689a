"""The shared step batcher (voicebot/serving/batcher.py) on a toy model whose answer is known: each
stream keeps a running total, a request's pieces are numbers, and a step adds each row's next number
to its stream's total. Rows join and leave between steps, a failing model call fails only its
batch's requests, and the queue is bounded with its refusals counted."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field

import pytest

from voicebot.serving.batcher import BatcherOverloaded, BatcherStopped, StepBatcher, StepFailed


class Stream:
    def __init__(self) -> None:
        self.total = 0


@dataclass(eq=False)
class Numbers:
    stream: Stream
    pieces: list[int]
    totals: list[int] = field(default_factory=list)


class Toy(Exception):
    pass


class Summer(StepBatcher[Numbers]):
    """Steps say they began (`entered`) and wait at `gate` (set: they run at once); a piece of -1
    makes its whole call raise, a request starting with "bad" fails as it is taken."""

    def __init__(self, max_batch: int = 64, max_pending: int = 64) -> None:
        super().__init__("toy", max_batch, max_pending)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[list[int]] = []  # the streams (by position in `streams`) of each call
        self.streams: list[Stream] = []
        self.dropped: list[Numbers] = []

    def submit(self, stream: Stream, pieces: list[int]) -> concurrent.futures.Future:
        return self._enqueue(stream, Numbers(stream, list(pieces)))

    def _take(self, request: Numbers) -> bool:
        if request.pieces[:1] == ["bad"]:
            raise ValueError("this request's input is unreadable")
        return bool(request.pieces)

    def _call(self, requests: list[Numbers]) -> None:
        self.entered.set()
        self.gate.wait(timeout=30)
        self.calls.append([self.streams.index(r.stream) for r in requests])
        if any(r.pieces[0] == -1 for r in requests):
            raise Toy("the device is lost")
        for request in requests:
            request.stream.total += request.pieces.pop(0)
            request.totals.append(request.stream.total)

    def _done(self, request: Numbers) -> bool:
        return not request.pieces

    def _result(self, request: Numbers) -> list[int]:
        return request.totals

    def _drop(self, request: Numbers) -> None:
        self.dropped.append(request)
        request.stream.total = 0


@pytest.fixture
def summer():
    batcher = Summer(max_batch=4)
    batcher.start()
    yield batcher
    batcher.stop()


def open_streams(batcher: Summer, n: int) -> list[Stream]:
    batcher.streams = [Stream() for _ in range(n)]
    return batcher.streams


def running_totals(pieces: list[int]) -> list[int]:
    out, total = [], 0
    for piece in pieces:
        total += piece
        out.append(total)
    return out


def test_rows_join_and_leave_between_steps_and_each_gets_its_own_answer(summer):
    """Stream 0 is in its first step when five more arrive with 1 to 5 pieces each; at most 4 rows
    a step, oldest first; each stream steps once per piece, in consecutive order of its own."""
    streams = open_streams(summer, 6)
    work = [[10 * i + k for k in range(1, n + 1)] for i, n in enumerate([3, 1, 2, 5, 4, 2])]
    summer.gate.clear()
    futures = [summer.submit(streams[0], work[0])]
    assert summer.entered.wait(timeout=30)  # stream 0's first step has begun
    futures += [summer.submit(s, w) for s, w in zip(streams[1:], work[1:])]
    summer.gate.set()
    for future, pieces in zip(futures, work):
        assert future.result(timeout=30) == running_totals(pieces)
    assert max(len(c) for c in summer.calls) == 4 == summer.max_batch  # full steps; the rest waited
    assert sum(summer.batch_sizes.values()) == len(summer.calls) and summer.pending == 0
    for i, pieces in enumerate(work):
        assert sum(i in c for c in summer.calls) == len(pieces)  # joined once, left after its last piece
    assert summer.calls[0] == [0] and summer.calls[1][:1] == [0]  # stream 0 stays the oldest row


def test_a_failing_model_call_fails_only_its_batchs_requests_with_a_clear_error(summer):
    streams = open_streams(summer, 3)
    summer.gate.clear()
    first = summer.submit(streams[0], [1, 1])
    assert summer.entered.wait(timeout=30)
    poisoned = summer.submit(streams[1], [-1, 5])  # joins stream 0's second step, which then raises
    summer.gate.set()
    for future in (first, poisoned):
        with pytest.raises(StepFailed, match=r"the toy model call of 2 rows failed \(Toy: the device is lost\)") as failed:
            future.result(timeout=30)
        assert isinstance(failed.value.__cause__, Toy)
    assert summer.calls == [[0], [0, 1]]
    assert {id(r.stream) for r in summer.dropped} == {id(streams[0]), id(streams[1])}
    assert streams[0].total == 0  # dropped: its stream starts afresh
    # The batcher goes on; the failed streams may submit again.
    assert summer.submit(streams[2], [3, 4]).result(timeout=30) == [3, 7]
    assert summer.submit(streams[0], [2]).result(timeout=30) == [2]
    assert summer.failed_requests == 2 and summer.thread_faults == 0 and summer.pending == 0


def test_a_request_whose_take_raises_fails_alone(summer):
    streams = open_streams(summer, 2)
    with pytest.raises(ValueError, match="unreadable"):
        summer.submit(streams[0], ["bad"]).result(timeout=30)
    assert summer.submit(streams[1], [4]).result(timeout=30) == [4]
    assert summer.failed_requests == 1 and summer.calls == [[1]]


def test_the_queue_is_bounded_and_refusals_are_counted():
    batcher = Summer(max_pending=2)  # not started: requests stay waiting
    streams = open_streams(batcher, 3)
    futures = [batcher.submit(streams[0], [1]), batcher.submit(streams[1], [2])]
    with pytest.raises(RuntimeError, match="one request per stream"):
        batcher.submit(streams[0], [1])
    with pytest.raises(BatcherOverloaded, match=r"2 toy requests waiting \(bound 2\)"):
        batcher.submit(streams[2], [3])
    assert batcher.pending == 2 and batcher.refused == 1 and batcher.stats()["refused"] == 1
    batcher.start()
    try:
        assert [f.result(timeout=30) for f in futures] == [[1], [2]]
        assert batcher.submit(streams[2], [3]).result(timeout=30) == [3]  # room again
    finally:
        batcher.stop()
    assert batcher.pending == 0


def test_a_request_cancelled_before_it_is_taken_is_not_run_and_is_counted():
    batcher = Summer()
    streams = open_streams(batcher, 2)
    gone = batcher.submit(streams[0], [1, 2])
    assert gone.cancel()
    batcher.start()
    try:
        assert batcher.submit(streams[1], [5]).result(timeout=30) == [5]
    finally:
        batcher.stop()
    assert batcher.calls == [[1]] and batcher.cancelled == 1 and batcher.pending == 0


def test_requests_still_waiting_fail_when_it_stops():
    batcher = Summer()
    streams = open_streams(batcher, 2)
    batcher.gate.clear()
    batcher.start()
    running = batcher.submit(streams[0], [1, 1, 1])
    assert batcher.entered.wait(timeout=30)
    waiting = batcher.submit(streams[1], [1])
    with batcher._cond:  # stop()'s first half, without its join of the thread held in the step
        batcher._stopping = True
    batcher.gate.set()
    for future in (running, waiting):
        with pytest.raises(BatcherStopped, match="the toy batcher has stopped"):
            future.result(timeout=30)
    batcher.stop()
    with pytest.raises(BatcherStopped):
        batcher.submit(streams[0], [1])
