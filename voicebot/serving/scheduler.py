"""One device's scheduler: the thread that owns the device's models and runs the work of every
session in shared steps.

Sessions submit typed requests (voicebot/serving/scheduler_requests.py) and await them.

Each loop iteration takes what has arrived, then runs: every ready `Call`; one LM step for every
decoding row in one batched forward (at most `max_batch` rows, earliest deadline first) plus at most
one prefill chunk (the most urgent), so a new prompt holds the others' decode for at most one chunk;
then the renders' step (voicebot/serving/render_queue.py: the most urgent in one call, at most one
running on the device beside the LM steps, held a few steps for company while they have audio to
spare). A released row (barge-in, the end of an utterance) leaves the batch at the next iteration
and its slot is free for the next `OpenRow`.

Bounds: at most `max_pending` requests are waiting (a session has one in flight at a time, so this
is a bound on sessions, not on work; each holds a few tensors of at most one chunk's tokens or one
sentence's text: kilobytes); `submit` raises `Overloaded` past it. Releases are at most one per row,
so at most `slots` are queued.

The scheduler measures what a step costs (`StepCosts`, voicebot/serving/step_costs.py);
`capacity()` is the most speaking sessions those costs keep in real time.

The thread outlives what is raised in it, as a Worker's calls do (voicebot/serving/worker.py), since
every session's speech waits on it:
- a step or call that raises fails only its own requests; what is not an `Exception` (SystemExit from
  a library's exit(), KeyboardInterrupt or another exception raised into the thread, a C
  extension's) arrives as `JobAborted`;
- anything that escapes the loop between steps fails every request the thread had taken, with
  `SchedulerFault`, and the loop starts again with what is still to come; the sessions release
  their rows as after any failure.
Both are counted (`thread_faults`, voicebot_scheduler_thread_faults_total).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from voicebot.serving.model_interfaces import DecodePool, DecodeRow, PoolFull, Rendering, finished
from voicebot.serving.render_queue import AudioBudget, RenderQueue
from voicebot.serving.scheduler_requests import Call, Decode, OpenRow, Overloaded, Render, Request, SchedulerFault, resolve
from voicebot.serving.step_costs import StepCosts
from voicebot.serving.worker import JobAborted

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, name: str, pool: DecodePool, render: Callable[[list[Any]], list[np.ndarray] | Rendering], *,
                 max_batch: int | None = None, max_render_batch: int = 8, render_hold_steps: int = 2,
                 max_pending: int = 256, render_budget: AudioBudget | None = None,
                 sample_rate: int = 24000, tokens_per_s: float = 25.0, headroom: float = 0.8) -> None:
        """`render(chunks)`: the audio (24 kHz float32) of several sessions' chunks, in one call,
        or a `Rendering` of it still running on the device; `render_budget`: a render call's bound
        in audio (render_queue.py)."""
        self.name, self.pool = name, pool
        self.max_batch = max_batch or pool.slots  # 1: every row steps alone (no batching)
        self.max_pending, self.sample_rate = max_pending, sample_rate
        self.tokens_per_s, self.headroom = tokens_per_s, headroom
        self.costs = StepCosts()
        self.batch_sizes: Counter[int] = Counter()  # decode steps run, by batch size
        self.refused = 0  # sessions refused by admission (counted by the synthesizer)
        self.thread_faults = 0  # BaseExceptions that were not Exceptions, and breaks of the loop, survived
        self._lock = threading.Condition()
        self._incoming: list[Request] = []
        self._released: list[DecodeRow] = []
        self._stopping = False
        self._held: set[Request] = set()  # requests the thread has taken and not yet answered
        # thread-only state
        self._opening: list[OpenRow] = []
        self._calls: list[Call] = []
        self._decoding: dict[DecodeRow, Decode] = {}
        self.renders = RenderQueue(name, render, self.costs, self._answer, self._aborted, max_batch=max_render_batch,
                                   hold_steps=render_hold_steps, sample_rate=sample_rate,
                                   budget=render_budget)  # thread-only
        self._thread = threading.Thread(target=self._run, name=f"scheduler-{name}", daemon=True)

    def calibrate(self, steps: int = 3, context: int = 200,
                  render_probe: Callable[[], list[Any]] | None = None) -> None:
        """Before start(): time the decode step at every batch size a step can take a CUDA graph
        for (the pool's step_sizes up to max_batch), with
        throwaway rows at a typical context length, so admission has costs before the first reply
        and no graph is captured while sessions wait on a step; live steps keep the costs current.
        `render_probe()`: fresh chunks `render` takes, made and rendered twice (a warm-up, then
        timed) for the render cost; without one (or if the probe renders no audio), admission lets
        one session speak until a render is measured."""
        pool = self.pool
        for size in pool.step_sizes(min(self.max_batch, pool.slots)):
            rows = [pool.open_idle(steps + 1, context) for _ in range(size)]
            for i in range(steps + 1):
                began = time.perf_counter()
                pool.decode(rows)
                pool.synchronize()
                if i:  # the first is a warm-up (and, on CUDA, the graph's capture)
                    self.costs.add_decode(size, time.perf_counter() - began)
            for row in rows:
                pool.close(row)
        if render_probe is not None:
            finished(self.renders.render(render_probe()))  # warm-up: first calls allocate and pick kernels
            chunks = render_probe()
            began = time.perf_counter()
            audio = finished(self.renders.render(chunks))
            self.costs.add_render(time.perf_counter() - began, sum(map(len, audio)) / self.sample_rate)

    # --- the sessions' side (event loop)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    @property
    def pending(self) -> int:
        """Requests submitted and not yet answered: the queue depth."""
        with self._lock:
            return len(self._incoming) + len(self._held)

    async def submit(self, request: Request) -> Any:
        loop = asyncio.get_running_loop()
        request.future = loop.create_future()
        with self._lock:
            if self._stopping:
                raise RuntimeError(f"scheduler {self.name} has stopped")
            if len(self._incoming) + len(self._held) >= self.max_pending:
                raise Overloaded(f"scheduler {self.name}: {self.max_pending} requests already waiting")
            self._incoming.append(request)
            self._lock.notify()
        return await request.future

    async def open_row(self, sampler: Any, prefix: Any, deadline: float) -> DecodeRow:
        return await self.submit(OpenRow(deadline, sampler, prefix))

    async def call(self, fn: Callable[[], Any], deadline: float) -> Any:
        return await self.submit(Call(deadline, fn))

    async def decode(self, row: DecodeRow, max_tokens: int, deadline: float) -> tuple[list[int], bool]:
        """Up to max_tokens tokens of `row`, and whether its program has ended."""
        return await self.submit(Decode(deadline, row, max_tokens))

    async def render(self, chunk: Any, deadline: float) -> np.ndarray:
        return await self.submit(Render(deadline, chunk))

    def release(self, row: DecodeRow) -> None:
        """Give the row's slot back (any thread, never blocks): it leaves the batch at the next step."""
        with self._lock:
            self._released.append(row)
            self._lock.notify()

    def capacity(self) -> int | None:
        """The most sessions speaking at once that keep the device under `headroom` busy (None
        before anything is measured). Until a render has been measured its cost is unknown, not
        zero: then at most one (the LM costs alone would let a burst of every slot in at once)."""
        if self.costs.decode_step(1) is None:
            return None
        n = 0
        while n < self.pool.slots and self.costs.load(n + 1, self.tokens_per_s, self.max_batch) <= self.headroom:
            n += 1
        return n if self.costs.render_per_audio_s is not None else min(n, 1)

    def stats(self) -> dict[str, Any]:
        return {"capacity": self.capacity(), "slots": self.pool.slots, "free_slots": self.pool.free,
                "queue_depth": self.pending, "max_batch": self.max_batch,
                "batch_sizes": dict(sorted(self.batch_sizes.items())),
                "render_batch_sizes": dict(sorted(self.renders.sizes.items())),
                "deadline_misses": self.renders.deadline_misses,
                "refused": self.refused, "thread_faults": self.thread_faults,
                "decode_step_s": {b: round(c, 4) for b, c in sorted(self.costs.decode.items())},
                "render_s_per_audio_s": self.costs.render_per_audio_s}

    # --- the thread

    def _run(self) -> None:
        try:
            while not self._loop():
                pass
        finally:  # stopped (or, past every guard, the thread is going): nobody may wait on it
            with self._lock:
                self._stopping = True
            self._fail_all(RuntimeError(f"scheduler {self.name} stopped"))

    def _loop(self) -> bool:
        """Iterate until stopped (True), or until something escapes an iteration (False): then
        every request the thread had taken has failed, and the caller loops again."""
        try:
            while True:
                with self._lock:
                    while not (self._stopping or self._incoming or self._released or self._has_work()):
                        self._lock.wait()
                    if self._stopping:
                        return True
                    self._held.update(self._incoming)
                    incoming, self._incoming = self._incoming, []
                self._close_released()
                self._take(incoming)
                self._iterate()
        except BaseException as exc:  # noqa: BLE001 -- its sessions wait on this thread: it must go on
            self._broken(exc)
            return False

    def _broken(self, exc: BaseException) -> None:
        """Fail what the thread held; its lists start empty (the rows' sessions release them)."""
        self.thread_faults += 1
        log.error("scheduler %s: its loop was broken (%s: %s); failing the %d requests it held and going on",
                  self.name, type(exc).__name__, exc, len(self._held), exc_info=exc)
        error = SchedulerFault(f"scheduler {self.name} was interrupted ({type(exc).__name__}: {exc}); "
                               "this request is lost")
        with self._lock:
            held = list(self._held)
        for request in held:
            row = request.row if isinstance(request, OpenRow) else None
            self._answer(request, exc=error, undo=None if row is None else functools.partial(self.release, row))
        self._opening, self._calls, self._decoding = [], [], {}
        self.renders.clear()

    def _has_work(self) -> bool:
        # Rows that cannot run yet (OpenRow while the pool is full) are not work.
        return bool(self._calls or self._decoding or self.renders.busy or (self._opening and self.pool.free))

    def _close_released(self) -> None:
        # Looked at, then taken: a row whose close is interrupted stays to be closed (closing is idempotent).
        while self._released:
            row = self._released[-1]
            stale = self._decoding.pop(row, None)
            if stale is not None:
                self._answer(stale, (stale.tokens, True))
            self.pool.close(row)
            with self._lock:
                self._released.pop()

    def _take(self, incoming: list[Request]) -> None:
        for request in incoming:
            if isinstance(request, OpenRow):
                self._opening.append(request)
            elif isinstance(request, Call):
                self._calls.append(request)
            elif isinstance(request, Decode):
                if request.row.closed:
                    self._answer(request, ([], True))
                else:
                    self._decoding[request.row] = request
            else:
                self.renders.waiting.append(request)

    def _iterate(self) -> None:
        by_deadline = lambda r: r.deadline  # noqa: E731
        self._opening.sort(key=by_deadline)
        while self._opening and self.pool.free:
            request = self._opening.pop(0)
            try:
                request.row = self.pool.open(request.sampler, request.prefix)
            except PoolFull as exc:  # cannot happen while free; kept as an answer, never a hang
                self._answer(request, exc=exc)
            else:
                self._answer(request, request.row, undo=functools.partial(self.release, request.row))
        calls, self._calls = sorted(self._calls, key=by_deadline), []
        for call in calls:
            self._run_request(call, call.fn)
        self._lm_step()
        self.renders.step(self._decoding.values())

    def _lm_step(self) -> None:
        """One forward for the decoding rows waiting on one position, one prefill chunk for the most
        urgent row with a longer step; answer the requests that got their tokens or ended."""
        # A row whose program has ended, or that got its tokens, is answered; none is left waiting.
        self._answer_decodes()
        requests = sorted(self._decoding.values(), key=lambda r: r.deadline)
        decode = [r.row for r in requests if r.row.waiting == 1][: self.max_batch]
        prefill = next((r.row for r in requests if r.row.waiting > 1), None)
        try:
            if decode:
                start = time.perf_counter()
                self.pool.decode(decode)
                self.costs.add_decode(len(decode), time.perf_counter() - start)
                self.batch_sizes[len(decode)] += 1
            if prefill is not None:
                self.pool.prefill(prefill)
        except BaseException as exc:  # fails only this step's rows
            log.exception("scheduler %s: LM step failed", self.name)
            error = self._aborted(exc)
            for row in {*decode, *([prefill] if prefill else [])}:
                self._answer(self._decoding.pop(row), exc=error)
            return
        self._answer_decodes()

    def _answer_decodes(self) -> None:
        for row, request in list(self._decoding.items()):
            request.tokens += row.take()
            if len(request.tokens) >= request.max_tokens or row.step is None:
                del self._decoding[row]
                self._answer(request, (request.tokens, row.step is None))

    def _run_request(self, request: Request, fn: Callable[[], Any]) -> None:
        if request.future.cancelled():  # its session stopped waiting (barge-in, disconnect)
            self._answer(request, None)
            return
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 -- fails only this request
            self._answer(request, exc=self._aborted(exc))
            return
        self._answer(request, result)

    def _aborted(self, exc: BaseException) -> Exception:
        """What a request that `exc` ended is answered with: an Exception as it is; anything else
        (it must never reach the event loop) as JobAborted, counted."""
        if isinstance(exc, Exception):
            return exc
        self.thread_faults += 1
        log.error("scheduler %s: %s raised in its thread; failing the requests it hit and going on",
                  self.name, type(exc).__name__)
        return JobAborted(f"{type(exc).__name__}: {exc}")

    def _answer(self, request: Request, result: Any = None, exc: BaseException | None = None,
                undo: Callable[[], None] | None = None) -> None:
        """Resolve the request's future on its loop; `undo` gives back what it holds (an LM slot)
        if the answer is not taken. Answered, then dropped from the held set, under the lock (so
        `pending` never counts an answered request): a fault between the two answers it twice, and
        the second answer is ignored."""
        with self._lock:
            try:
                request.future.get_loop().call_soon_threadsafe(resolve, request.future, result, exc, undo)
            except RuntimeError:  # its event loop has closed: nobody is waiting any more
                pass
            self._held.discard(request)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            pending = [*self._incoming, *self._held]
            self._incoming = []
        for request in pending:
            self._answer(request, exc=exc)
        self._opening, self._calls, self._decoding = [], [], {}
        self.renders.clear()

