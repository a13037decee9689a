"""Every live session's newly arrived audio through the front end and Silero VAD, as one job per tick.

A session hands its waiting chunks to the clock (`hear`: its FrontEnd and the chunks) and awaits
their VAD windows and speech probabilities. One thread, woken by the first chunk after it was idle
and otherwise by its own timer, its ticks at least TICK_S apart, takes every session's chunks that
arrived since its last tick and runs, for each, the resampler, echo canceller, gate and window cutting (`FrontEnd.prepare`),
then Silero on every session's windows together (one `silero_step` per step: the next window of
each session that has one), and hands all the answers back to the event loop in one call.

Why: the main process's threads (the event loop, this one) share one GIL. Handing each session's
chunk to a worker thread, then to the VAD batcher's, and back, woke a thread and crossed the GIL
two or three times per chunk per session (a profile at 16 live speakers: 140 µs of the loop's
GIL time per chunk in waking the audio worker alone); a thread woken while another holds the GIL
waits for it, so on a busy box the cost of a chunk grew with the sessions waiting. Here the
wake-ups and hand-backs are one per tick whatever the number of sessions; a chunk waits at most
TICK_S for its tick, not at all when the clock was idle.

Each session's Silero state is its own (`FrontEnd.silero`), so its probabilities do not
depend on who else is in a step (the VAD batcher's tests, same call). The /funasr route's segmenter
and the transcription endpoint keep the VAD batcher (voicebot/serving/vad.py).

Bounds: one job per session at a time (a session awaits its own), at most `max_pending` (1024)
waiting, each at most a session's input queue of chunks (machine.AUDIO_IN_MAX); `hear` raises
`InputOverloaded` past it. A step takes at most MAX_BATCH rows.

Faults: a front end that raises fails its own job; a Silero call that raises fails its rows'
jobs (`InputStepFailed`); anything that escapes a tick fails every job of that tick
(`InputClockFault`, counted in `thread_faults`) and the clock goes on. Stopped, every job still
waiting fails with `InputClockStopped`.

Counted for admission and the metrics: `busy_s` (the thread's CPU seconds in ticks), of which
`front_end_busy_s` and `vad_busy_s`; `ticks` and `jobs` (so jobs per tick); `batch_sizes` (Silero
calls by rows: voicebot_vad_calls_total, with the VAD batcher's).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from voicebot.serving.silero import SileroVad, silero_session, silero_step

log = logging.getLogger(__name__)

# Ticks begin at least this far apart: what arrives meanwhile waits for the next (up to 10 ms; none
# when the clock was idle longer), and the clock wakes at most 100 times a second however many
# sessions send. Shorter than a microphone's 20 ms chunk on purpose: with spacing as long as the
# chunks' period, each tick (begun a wake-up's latency after its chunk) pushed the next later, until
# every chunk of a lone speaker waited a whole tick (measured: 20 ms a chunk, p50; now 1.2 ms).
TICK_S = 0.01
MAX_BATCH = 64
# What a session whose chunk found the clock full is told (retry_after_s): it drains every tick.
INPUT_RETRY_AFTER_S = 1


class InputOverloaded(RuntimeError):
    """More sessions' input is waiting than the clock's bound."""


class InputStepFailed(RuntimeError):
    """The Silero call this job's windows were in raised; the other jobs go on."""


class InputClockFault(RuntimeError):
    """Something escaped the tick this job was in; the clock goes on."""


class InputClockStopped(RuntimeError):
    """The clock stopped before this job was done."""


class FrontEnd(Protocol):
    """A session's signal path (voicebot/session/listening.py's FrontEnd)."""

    @property
    def silero(self) -> SileroVad: ...  # its stream's state

    def prepare(self, *chunks: object) -> tuple[np.ndarray, int, np.ndarray]: ...  # AudioIn in; windows, muted, suppressing


@dataclass(frozen=True)
class Heard:
    """What the clock made of one session's chunks."""

    windows: np.ndarray  # (k, WINDOW) of the gated audio
    probabilities: np.ndarray  # (k,) Silero's, one per window
    muted_samples: int  # the gate's, at LISTEN_RATE
    suppressing: np.ndarray  # (k,) whether the echo canceller suppressed when each window's chunk came


@dataclass(eq=False)
class _Job:
    front_end: FrontEnd
    chunks: Sequence[object]  # the session's AudioIn, as its FrontEnd takes them
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    prepared: tuple[np.ndarray, int, np.ndarray] | None = None  # FrontEnd.prepare's
    probabilities: np.ndarray | None = None
    error: BaseException | None = None


class InputClock:
    name = "input"  # as admission control and /readyz show the pool
    threads = 1

    def __init__(self, tick_s: float = TICK_S, max_pending: int = 1024) -> None:
        self.tick_s = tick_s
        self.max_pending = max_pending
        self.busy_s = 0.0
        self.front_end_busy_s = 0.0
        self.vad_busy_s = 0.0
        self.ticks = 0
        self.jobs = 0
        self.thread_faults = 0
        self.batch_sizes: Counter[int] = Counter()  # Silero calls run, by rows in the call
        self._incoming: list[_Job] = []
        self._cond = threading.Condition()
        self._idle = False  # nothing to do and a tick's spacing over: the next `hear` wakes it
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        silero_session()  # the graph loaded before the first session needs it
        self._thread = threading.Thread(target=self._run, name="input-clock", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def pending(self) -> int:
        return len(self._incoming)

    @property
    def ident(self) -> int:
        """Its thread's id (admission watches its CPU with the event loop's: they share the GIL)."""
        if self._thread is None or self._thread.ident is None:
            raise RuntimeError("the input clock is not started")
        return self._thread.ident

    def stats(self) -> dict:
        return {"ticks": self.ticks, "jobs_per_tick": round(self.jobs / self.ticks, 2) if self.ticks else None,
                "pending": self.pending, "max_pending": self.max_pending, "thread_faults": self.thread_faults}

    async def hear(self, front_end: FrontEnd, chunks: Sequence[object]) -> Heard:
        """One session's consecutive chunks through its front end and Silero, at the next tick."""
        loop = asyncio.get_running_loop()
        job = _Job(front_end, chunks, loop, loop.create_future())
        with self._cond:
            if self._stopping:
                raise InputClockStopped("the input clock has stopped")
            if len(self._incoming) >= self.max_pending:
                raise InputOverloaded(f"{len(self._incoming)} sessions' input waiting (bound {self.max_pending})")
            self._incoming.append(job)
            if self._idle:  # the only wake-up not on the clock's own time
                self._idle = False
                self._cond.notify()
        return await job.future

    def _run(self) -> None:
        next_tick = 0.0  # the earliest the next tick may begin
        while True:
            with self._cond:
                while not self._stopping:
                    now = time.monotonic()
                    if now < next_tick:  # what arrives until then waits for it: no wake-up of its own
                        self._cond.wait(next_tick - now)
                    elif self._incoming:
                        break
                    else:
                        self._idle = True
                        self._cond.wait()
                        self._idle = False
                jobs, self._incoming = self._incoming, []
                if self._stopping:
                    break
            next_tick = time.monotonic() + self.tick_s
            self._tick(jobs)
        for job in jobs:
            job.error = InputClockStopped("the input clock has stopped")
        self._answer(jobs)

    def _tick(self, jobs: list[_Job]) -> None:
        start = time.thread_time()
        try:
            live = [job for job in jobs if not job.future.cancelled()]  # a session gone: its input is not run
            for job in live:
                try:
                    job.prepared = job.front_end.prepare(*job.chunks)
                except Exception as exc:  # this session's input is bad: it fails, the others go on
                    job.error = exc
            middle = time.thread_time()
            self.front_end_busy_s += middle - start
            self._judge([job for job in live if job.error is None])
            self.vad_busy_s += time.thread_time() - middle
        except BaseException as exc:  # every session's input goes through this thread: it goes on
            self.thread_faults += 1
            log.error("input clock: a tick was broken (%s: %s); failing its %d jobs and going on",
                      type(exc).__name__, exc, len(jobs), exc_info=exc)
            for job in jobs:
                job.error = InputClockFault(f"the input clock's tick was interrupted ({type(exc).__name__}: {exc})")
        finally:
            self.busy_s += time.thread_time() - start
            self.ticks += 1
            self.jobs += len(jobs)
        self._answer(jobs)

    def _judge(self, jobs: list[_Job]) -> None:
        """Silero on every job's windows: step k takes the k-th window of each job that has one."""
        for job in jobs:
            job.probabilities = np.zeros(len(job.prepared[0]), np.float32)
        steps = max((len(job.prepared[0]) for job in jobs), default=0)
        for k in range(steps):
            rows = [job for job in jobs if job.error is None and len(job.prepared[0]) > k]
            for first in range(0, len(rows), MAX_BATCH):
                batch = rows[first : first + MAX_BATCH]
                try:
                    self.batch_sizes[len(batch)] += 1
                    out = silero_step([job.front_end.silero for job in batch],
                                      np.stack([job.prepared[0][k] for job in batch]))
                except Exception as exc:  # its rows fail; the other steps go on
                    log.exception("input clock: a Silero call of %d rows failed", len(batch))
                    for job in batch:
                        job.error = InputStepFailed(f"the VAD call of {len(batch)} rows failed ({type(exc).__name__}: {exc})")
                    continue
                for job, probability in zip(batch, out):
                    job.probabilities[k] = probability

    def _answer(self, jobs: list[_Job]) -> None:
        """Every job's answer to its loop, in one call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Job]] = {}
        for job in jobs:
            by_loop.setdefault(job.loop, []).append(job)
        for loop, answered in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle, answered)
            except RuntimeError:  # the loop is closed: nobody waits for these
                pass


def _settle(jobs: list[_Job]) -> None:
    """On the loop: each job's future gets its answer (not one its session cancelled)."""
    for job in jobs:
        if job.future.done():
            continue
        if job.error is not None:
            job.future.set_exception(job.error)
        elif job.prepared is None:
            job.future.cancel()  # cancelled while it waited: never run
        else:
            windows, muted, suppressing = job.prepared
            job.future.set_result(Heard(windows, job.probabilities, muted, suppressing))
