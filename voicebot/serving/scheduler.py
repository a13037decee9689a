"""One device's scheduler: the thread that owns the device's models and runs the work of every
session in shared steps.

Sessions submit typed requests and await them (asyncio futures, resolved from the thread with
`loop.call_soon_threadsafe`; nothing polls):

- `OpenRow`: an LM slot for a new utterance (waits while all slots are in use);
- `Call`: small blocking work on the models' thread (start a program, push a sentence's text);
- `Decode`: up to n speech tokens of an LM row; the row's long steps (prefills) are fed in chunks;
- `Render`: one chunk of a session's audio (a flow + vocoder chunk: Token2WavStream.next_chunk).

Each loop iteration takes what has arrived, then runs: every ready `Call`; one LM step for every
decoding row in one batched forward (at most `max_batch` rows, earliest deadline first) plus at most
one prefill chunk (the most urgent), so a new prompt holds the others' decode for at most one chunk;
then the most urgent `Render`s, at most `max_render_batch` of them, in one `render` call (one flow
call and one vocoder call for all of them: Token2Wav.render). Sessions reach their chunk boundaries
at different steps, so a render whose listener still has audio to spare (more than twice the last
render call's cost plus RENDER_MARGIN_S) waits while a more urgent row decodes, and up to
`render_hold_steps` LM steps for others to join it; a new reply's first chunk never waits. A deadline is when that session's listener runs out of audio;
a new reply's has already passed, so its first chunk goes first. A released row (barge-in, the end
of an utterance) leaves the batch at the next iteration and its slot is free for the next `OpenRow`.

Bounds: at most `max_pending` requests are waiting (a session has one in flight at a time, so this
is a bound on sessions, not on work; each holds a few tensors of at most one chunk's tokens or one
sentence's text: kilobytes); `submit` raises `Overloaded` past it. Releases are at most one per row,
so at most `slots` are queued.

The scheduler measures what a step costs (`StepCosts`): the LM decode step per batch size, measured
at start-up (`calibrate`) and kept current by every step; the render cost per second of audio, from
every render. `capacity()` is the most speaking sessions those costs keep in real time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from voicebot.serving.lm_pool import LMPool, LMRow, PoolFull
from voicebot.tts.cosyvoice2.lm import Program, PromptPrefix, Step
from voicebot.tts.cosyvoice2.sampling import Sampler, greedy

log = logging.getLogger(__name__)


RENDER_MARGIN_S = 0.1  # slack a held render keeps beyond twice the render cost


class Overloaded(RuntimeError):
    """More requests are waiting than the scheduler's bound."""


@dataclass(eq=False)
class Request:
    deadline: float  # time.monotonic() when the session's listener runs out of audio
    future: asyncio.Future = field(init=False)
    submitted: float = field(init=False, default_factory=time.monotonic)


@dataclass(eq=False)
class OpenRow(Request):
    sampler: Sampler
    prefix: PromptPrefix | None = None


@dataclass(eq=False)
class Call(Request):
    fn: Callable[[], Any]


@dataclass(eq=False)
class Decode(Request):
    row: LMRow
    max_tokens: int
    tokens: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Render(Request):
    chunk: Any  # what `render` takes, one per session: a Token2Wav ChunkRequest
    held: int = 0  # LM steps it has waited for others to join it


class StepCosts:
    """Exponential moving averages of what the device spends: seconds per LM decode step by batch
    size, and seconds of rendering per second of audio. Thread-safe reads (floats)."""

    ALPHA = 0.1

    def __init__(self) -> None:
        self.decode: dict[int, float] = {}
        self.render_per_audio_s: float | None = None
        self.render_call: float | None = None  # seconds per render call

    def add_decode(self, batch: int, seconds: float) -> None:
        old = self.decode.get(batch)
        self.decode[batch] = seconds if old is None else old + self.ALPHA * (seconds - old)

    def add_render(self, seconds: float, audio_s: float) -> None:
        old = self.render_call
        self.render_call = seconds if old is None else old + self.ALPHA * (seconds - old)
        if audio_s <= 0:
            return
        rate, old = seconds / audio_s, self.render_per_audio_s
        self.render_per_audio_s = rate if old is None else old + self.ALPHA * (rate - old)

    def decode_step(self, batch: int) -> float | None:
        """The cost of a step at `batch` rows, interpolated linearly between measured sizes
        (extrapolated from the two largest above them)."""
        sizes = sorted(self.decode)
        if not sizes:
            return None
        if batch in self.decode:
            return self.decode[batch]
        below = [s for s in sizes if s < batch]
        above = [s for s in sizes if s > batch]
        if below and above:
            a, b = below[-1], above[0]
        elif len(below) >= 2:
            a, b = below[-2], below[-1]
        else:
            return self.decode[sizes[0]]
        ca, cb = self.decode[a], self.decode[b]
        return max(ca, ca + (cb - ca) * (batch - a) / (b - a))

    def load(self, speaking: int, tokens_per_s: float, max_batch: int) -> float | None:
        """Busy fraction of the device with `speaking` sessions in real time: 25 LM steps a second
        for every batch of up to max_batch of them, plus each session's render cost."""
        batches, rows = math.ceil(speaking / max_batch), min(speaking, max_batch)
        step = self.decode_step(rows)
        if step is None:
            return None
        return tokens_per_s * batches * step + speaking * (self.render_per_audio_s or 0.0)


class Scheduler:
    def __init__(self, name: str, pool: LMPool, render: Callable[[list[Any]], list[np.ndarray]], *,
                 max_batch: int | None = None, max_render_batch: int = 8, render_hold_steps: int = 2,
                 max_pending: int = 256,
                 sample_rate: int = 24000, tokens_per_s: float = 25.0, headroom: float = 0.8) -> None:
        """`render(chunks)`: the audio (24 kHz float32) of several sessions' chunks, in one call."""
        self.name, self.pool, self.render_chunks = name, pool, render
        self.max_batch = max_batch or pool.slots  # 1: every row steps alone (no batching)
        self.max_render_batch, self.render_hold_steps = max_render_batch, render_hold_steps
        self.max_pending, self.sample_rate = max_pending, sample_rate
        self.tokens_per_s, self.headroom = tokens_per_s, headroom
        self.costs = StepCosts()
        self.batch_sizes: Counter[int] = Counter()  # decode steps run, by batch size
        self.render_sizes: Counter[int] = Counter()  # render calls, by chunks in the call
        self.deadline_misses = 0  # renders done after a listener that had audio ran out
        self.refused = 0  # sessions refused by admission (counted by the synthesizer)
        self._lock = threading.Condition()
        self._incoming: list[Request] = []
        self._released: list[LMRow] = []
        self._stopping = False
        self._queued = 0  # requests moved to the thread's lists, not yet answered
        # thread-only state
        self._opening: list[OpenRow] = []
        self._calls: list[Call] = []
        self._decoding: dict[LMRow, Decode] = {}
        self._renders: list[Render] = []
        self._thread = threading.Thread(target=self._run, name=f"scheduler-{name}", daemon=True)

    def calibrate(self, steps: int = 3, context: int = 200) -> None:
        """Before start(): time the decode step at batch sizes 1, 2, 4, ... up to max_batch, with
        throwaway rows at a typical context length, so admission has costs before the first reply;
        live steps keep them current."""
        lm, pool = self.pool.lm, self.pool
        w = lm.llm_decoder.weight
        x = torch.zeros(1, 1, w.shape[1], device=w.device, dtype=w.dtype)
        start = max(0, min(context, pool.max_seq_len - steps - 2))
        top = min(self.max_batch, pool.slots)
        sizes = sorted({*(2**i for i in range(top.bit_length()) if 2**i <= top), top})
        for size in sizes:
            rows = [pool.open(greedy) for _ in range(size)]
            for row in rows:
                pool.start(row, _idle(x, start, steps + 1))
            for i in range(steps + 1):
                began = time.perf_counter()
                pool.decode(rows)
                if w.device.type == "cuda":
                    torch.cuda.synchronize()
                if i:  # the first is a warm-up (and, on CUDA, the graph's capture)
                    self.costs.add_decode(size, time.perf_counter() - began)
            for row in rows:
                pool.close(row)

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
            return len(self._incoming) + self._queued

    async def submit(self, request: Request) -> Any:
        loop = asyncio.get_running_loop()
        request.future = loop.create_future()
        with self._lock:
            if len(self._incoming) + self._queued >= self.max_pending:
                raise Overloaded(f"scheduler {self.name}: {self.max_pending} requests already waiting")
            self._incoming.append(request)
            self._lock.notify()
        return await request.future

    async def open_row(self, sampler: Sampler, prefix: PromptPrefix | None, deadline: float) -> LMRow:
        return await self.submit(OpenRow(deadline, sampler, prefix))

    async def call(self, fn: Callable[[], Any], deadline: float) -> Any:
        return await self.submit(Call(deadline, fn))

    async def decode(self, row: LMRow, max_tokens: int, deadline: float) -> tuple[list[int], bool]:
        """Up to max_tokens tokens of `row`, and whether its program has ended."""
        return await self.submit(Decode(deadline, row, max_tokens))

    async def render(self, chunk: Any, deadline: float) -> np.ndarray:
        return await self.submit(Render(deadline, chunk))

    def release(self, row: LMRow) -> None:
        """Give the row's slot back (any thread, never blocks): it leaves the batch at the next step."""
        with self._lock:
            self._released.append(row)
            self._lock.notify()

    def capacity(self) -> int | None:
        """The most sessions speaking at once that keep the device under `headroom` busy (None
        before anything is measured)."""
        if self.costs.decode_step(1) is None:
            return None
        n = 0
        while n < self.pool.slots and self.costs.load(n + 1, self.tokens_per_s, self.max_batch) <= self.headroom:
            n += 1
        return n

    def stats(self) -> dict[str, Any]:
        return {"capacity": self.capacity(), "slots": self.pool.slots, "free_slots": self.pool.free,
                "queue_depth": self.pending, "max_batch": self.max_batch,
                "batch_sizes": dict(sorted(self.batch_sizes.items())),
                "render_batch_sizes": dict(sorted(self.render_sizes.items())), "deadline_misses": self.deadline_misses,
                "refused": self.refused,
                "decode_step_s": {b: round(c, 4) for b, c in sorted(self.costs.decode.items())},
                "render_s_per_audio_s": self.costs.render_per_audio_s}

    # --- the thread

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._incoming or self._released or self._has_work()):
                    self._lock.wait()
                if self._stopping:
                    break
                incoming, self._incoming = self._incoming, []
                released, self._released = self._released, []
                self._queued += len(incoming)
            self._take(incoming, released)
            try:
                self._iterate()
            except Exception:  # a bug here must not leave every session waiting forever
                log.exception("scheduler %s: iteration failed", self.name)
        self._fail_all(RuntimeError(f"scheduler {self.name} stopped"))

    def _has_work(self) -> bool:
        # Rows that cannot run yet (OpenRow while the pool is full) are not work.
        return bool(self._calls or self._decoding or self._renders or (self._opening and self.pool.free))

    def _take(self, incoming: list[Request], released: list[LMRow]) -> None:
        for row in released:
            stale = self._decoding.pop(row, None)
            if stale is not None:
                self._answer(stale, (stale.tokens, True))
            self.pool.close(row)
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
                self._renders.append(request)

    def _iterate(self) -> None:
        by_deadline = lambda r: r.deadline  # noqa: E731
        self._opening.sort(key=by_deadline)
        while self._opening and self.pool.free:
            request = self._opening.pop(0)
            try:
                self._answer(request, self.pool.open(request.sampler, request.prefix), on_cancel=self.release)
            except PoolFull as exc:  # cannot happen while free; kept as an answer, never a hang
                self._answer(request, exc=exc)
        calls, self._calls = sorted(self._calls, key=by_deadline), []
        for call in calls:
            self._run_request(call, call.fn)
        self._lm_step()
        self._render_step()

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
        except Exception as exc:
            log.exception("scheduler %s: LM step failed", self.name)
            for row in {*decode, *([prefill] if prefill else [])}:
                self._answer(self._decoding.pop(row), exc=exc)
            return
        self._answer_decodes()

    def _render_step(self) -> None:
        """The most urgent renders, in one call; each answered with its audio."""
        self._renders.sort(key=lambda r: r.deadline)
        if self._renders and self._may_hold(self._renders[0]):
            for request in self._renders:
                request.held += 1
            return
        batch: list[Render] = []
        while self._renders and len(batch) < self.max_render_batch:
            request = self._renders.pop(0)
            if request.future.cancelled():  # its session stopped waiting (barge-in, disconnect)
                self._answer(request, None)
            else:
                batch.append(request)
        if not batch:
            return
        start = time.perf_counter()
        try:
            audio = self.render_chunks([r.chunk for r in batch])
        except Exception as exc:
            log.exception("scheduler %s: render failed", self.name)
            for request in batch:
                self._answer(request, exc=exc)
            return
        self.costs.add_render(time.perf_counter() - start, sum(map(len, audio)) / self.sample_rate)
        self.render_sizes[len(batch)] += 1
        done = time.monotonic()
        for request, samples in zip(batch, audio, strict=True):
            if request.submitted < request.deadline < done:
                self.deadline_misses += 1
            self._answer(request, samples)

    def _may_hold(self, urgent: Render) -> bool:
        """Hold the renders one more step, if the most urgent one's listener has audio to spare and
        the batch has room: while a decoding row is more urgent still (earliest deadline first
        across kinds: a new reply's first chunk is not kept waiting behind others' renders), or for
        up to render_hold_steps steps while others decode towards a chunk of their own."""
        if not self._decoding or len(self._renders) >= self.max_render_batch:
            return False
        if urgent.deadline - time.monotonic() <= 2 * (self.costs.render_call or 0.0) + RENDER_MARGIN_S:
            return False
        if min(request.deadline for request in self._decoding.values()) < urgent.deadline:
            return True
        return urgent.held < self.render_hold_steps

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
        except Exception as exc:
            self._answer(request, exc=exc)
            return
        self._answer(request, result)

    def _answer(self, request: Request, result: Any = None, exc: BaseException | None = None,
                on_cancel: Callable[[Any], None] | None = None) -> None:
        with self._lock:
            self._queued -= 1
        try:
            request.future.get_loop().call_soon_threadsafe(_resolve, request.future, result, exc, on_cancel)
        except RuntimeError:  # its event loop has closed: nobody is waiting any more
            pass

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
            self._queued += len(incoming)
        for request in [*incoming, *self._opening, *self._calls, *self._decoding.values(), *self._renders]:
            self._answer(request, exc=exc)
        self._opening, self._calls, self._decoding, self._renders = [], [], {}, []


def _idle(x: torch.Tensor, start: int, n: int) -> Program:
    """A throwaway program: n one-position steps from `start` (calibration)."""
    for i in range(n):
        yield Step(x, start + i, ())


def _resolve(future: asyncio.Future, result: Any, exc: BaseException | None,
             on_cancel: Callable[[Any], None] | None) -> None:
    """On the loop: answer the future, or undo what a cancelled one would have received."""
    if future.cancelled():
        if on_cancel is not None and exc is None:
            on_cancel(result)
    elif exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
