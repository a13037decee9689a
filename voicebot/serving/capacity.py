"""Admission control for the CPU engines: the thread pools that cannot batch (pocketsphinx's decoding
processes, espeak-ng, Smart Turn), the input clock, the VAD batcher, the main process's GIL, and
what the listener feels: each session's input lag (voicebot/serving/lateness.py).

A pool's load is the share of its threads' time spent running calls over a sliding window (CPU
time: a call waiting for a core costs what it computes). The GIL is a pool of one thread
(`GilThreads`: the event loop's and the input clock's CPU together; every chunk of every session
passes through both); the whole server (`ServerCpu`) is a pool of one thread per core.

A new session is refused with `busy` and a retry-after (`Refusal`, and its `reason`, counted in
voicebot_sessions_refused_total{reason}) when
- `input_lag`: more than LATE_SHARE of the chunks processed in the last window missed their deadline
  (`limits.max_input_lag_s`), in at least LATE_SESSIONS sessions: the speakers already in are falling
  behind real time, whatever holds the CPU (our pools, or another tenant of the box: either way one
  more session only adds to it). One session late alone is its own matter (its decoding process
  restarting after a crash, its client sending a backlog at once); it is counted all the same.
  Also (`input_lag`) when one more session would bring the number connected back to one the input
  was late at within the last minute (`LateLevels`): a burst of connects does not repeat it.
- `input_lag_forecast`: the lag p95 forecast with one more session (`Admission.forecast`: the lag
  measured, per number of sessions and in the last window, as a queue's over the busiest pool's
  load, at that pool's load with one more) is past the deadline: a burst of connects is refused at
  the count the lag it already shows says is too many, before a whole window of it is late (asked
  last: a pool full or in its cold start says so by name first);
- `pool_load`: a pool is above `limits.max_worker_load` now, or the line its load follows with the
  number of sessions connected says one more would pass that limit; this catches a burst of
  connections that have not started speaking. The line (`PoolLoad.line`): the pool's load over each
  whole window with sessions in it (an average over time, so a session's pauses count) is kept per
  number of sessions connected (a level), and the load is fitted as `fixed + marginal x sessions`
  through the levels. The marginal cost, not the average: what sessions share (the VAD's and
  the recognizers' batches, the loop's ticks) is paid once, and a speaker among 8 costs less than a
  lone one. With one level seen, the line runs from the idle load through it (the average cost over
  the idle load: what a pool does with no session connected, its own timers and samplers, the least
  seen over a whole window without sessions, is no session's cost);
- the sessions admitted in the last window, whose load the window does not hold yet, plus this one,
  at a pool's marginal cost, would pass the limit (`pool_load`); before a pool's cost is known
  (learnt, or bounded by a window too idle to learn from), `cold_start`: at most
  `limits.cold_start_sessions` are let in per window. The same pace (`cold_start`) beyond the most
  sessions the input lag was measured with (connected throughout a whole window, `LagLevels`): no
  load shows what a burst's first seconds cost where nothing was measured (a decoder built for each
  stream beyond the recognizer's pool, a core another tenant holds), so each step is measured
  before the next.
The first session always fits: it slows nobody. An admitted session is never dropped for load:
these rules only keep the next one out.
Devices whose engines batch (the CosyVoice 2 scheduler) answer for themselves through
`Synthesizer.admit()`; both are asked.

Memory bound: per pool a window of WINDOW_S / SAMPLE_S samples (three numbers each) and at most
LEVELS_MAX levels; the recent admissions at most ADMISSIONS_MAX times (the lag's: lateness.py).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np

from voicebot.serving.lateness import LATE_SESSIONS, LATE_SHARE, WINDOW_S, Connected, InputLag, LagLevels, LateLevels

SAMPLE_S = 0.5
# How fast a level's load follows a new measurement (per sample): about 20 s to settle.
COST_EWMA = 0.025
# The numbers of sessions whose loads are kept (the most recently seen).
LEVELS_MAX = 64
# A level weighs in the line by its samples, up to this many (a minute): a level seen for long does
# not drown out the others.
LEVEL_WEIGHT_MAX = 120
# The marginal cost is kept at least this share of the least average cost per session: a noisy line
# can come out flat, and admitting by it would fill the pool.
MARGINAL_FLOOR = 0.5
# Below this load a pool's cost per session is too small to measure; it is not learnt from, only
# bounded (at most this load over the sessions connected).
MIN_LOAD_TO_LEARN = 0.05
# A window with nobody connected is taken as the pool's idle load only under this: above it the pool
# is busy with something that ends (models loading, a decoding child starting), and taking that off
# every session's cost would over-admit.
IDLE_LOAD_MAX = 0.1
ADMISSIONS_MAX = 1024


class Pool(Protocol):
    """What the load is read from: a Worker, the VAD batcher, a decoding process, the loop."""

    name: str
    threads: int

    @property
    def busy_s(self) -> float: ...  # CPU seconds spent running calls since start


class GilThreads:
    """The main process's threads that carry every live session's input and share its one GIL: the
    event loop's (the thread that builds this: Admission.watch) and the input clock's
    (voicebot/serving/input_clock.py, by its thread id). A pool of one thread: their CPU seconds
    together are how long the GIL was held for the sessions' input, sockets and turn-taking (an
    upper bound: the clock's Silero calls run without it). No other pool sees this: at 16 live
    speakers the box was half idle while every session's chunks waited for the GIL."""

    name = "gil"
    threads = 1

    def __init__(self, idents: Iterable[int] = ()) -> None:
        self._clocks = [time.pthread_getcpuclockid(ident) for ident in (threading.get_ident(), *idents)]

    @property
    def busy_s(self) -> float:
        return sum(time.clock_gettime(clock) for clock in self._clocks)


class ServerCpu:
    """The whole server as a pool with one thread per core it may use: its process's CPU seconds (the
    loop and every thread) and its decoding children's (`children`). Each pool can have room while
    together they fill the box: this is the pool that says so."""

    name = "server"

    def __init__(self, children: Callable[[], float] = lambda: 0.0) -> None:
        self.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._children = children

    @property
    def busy_s(self) -> float:
        return time.process_time() + self._children()


@dataclass(frozen=True)
class Refusal:
    reason: str  # input_lag, pool_load, cold_start, input_lag_forecast
    pool: str  # the pool that is late or full
    retry_after_s: float
    message: str


@dataclass
class Level:
    """A pool's load with about `sessions` connected: both averaged over the samples whose window held
    that many on average (rounded); the plain mean of the first 1 / COST_EWMA, then an EWMA."""

    sessions: float
    load: float
    samples: int = 1

    def add(self, sessions: float, load: float) -> None:
        self.samples += 1
        weight = max(1 / self.samples, COST_EWMA)
        self.sessions += weight * (sessions - self.sessions)
        self.load += weight * (load - self.load)


class PoolLoad:
    """One worker pool's load: busy thread-seconds / (threads x elapsed), over the last WINDOW_S; and
    what one more session would add to it (its marginal cost), from the loads seen at each number of
    sessions (`levels`)."""

    def __init__(self, worker: Pool, clock: Callable[[], float] = time.monotonic) -> None:
        self.worker = worker
        self._clock = clock
        # (when, busy seconds, sessions connected) per sample
        self._samples: deque[tuple[float, float, int]] = deque(maxlen=int(WINDOW_S / SAMPLE_S) + 1)
        self.levels: dict[int, Level] = {}  # by sessions connected, rounded; at most LEVELS_MAX
        self.cost_bound: float | None = None  # at most this per session, while too idle to learn
        self._sessions_since: float | None = None  # when the sessions connected last went from none to some
        self._idle_since: float | None = None  # when the sessions connected last went from some to none
        self.idle_load: float = 0.0  # the least load of a whole window with no session (0 until one is seen)
        self._idle_seen = False

    def sample(self, sessions: int) -> float:
        now = self._clock()
        self._samples.append((now, self.worker.busy_s, sessions))
        if not sessions:
            self._sessions_since = None
            self._idle_since = now if self._idle_since is None else self._idle_since
        else:
            self._idle_since = None
            self._sessions_since = now if self._sessions_since is None else self._sessions_since
        load = self.load()
        if not sessions and self._idle_since <= now - WINDOW_S and load <= IDLE_LOAD_MAX:
            self.idle_load = load if not self._idle_seen else min(self.idle_load, load)
            self._idle_seen = True
        # Learnt only from a whole window with sessions in it: a session's start-up, or a window
        # that was mostly empty, says nothing of what one costs.
        if sessions and self._sessions_since <= now - WINDOW_S:
            connected = float(np.mean([n for _, _, n in list(self._samples)[1:]]))  # over the window's intervals
            if load >= MIN_LOAD_TO_LEARN:
                self._learn(connected, load)
            else:
                self.cost_bound = min(self.cost_bound or 1.0, MIN_LOAD_TO_LEARN / connected)
        return load

    def _learn(self, connected: float, load: float) -> None:
        key = round(connected)
        if key in self.levels:
            self.levels[key].add(connected, load)
            self.levels[key] = self.levels.pop(key)  # the most recently seen last
        else:
            self.levels[key] = Level(connected, load)
            if len(self.levels) > LEVELS_MAX:
                del self.levels[next(iter(self.levels))]  # the least recently seen

    def load(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, busy0, _), (t1, busy1, _) = self._samples[0], self._samples[-1]
        return (busy1 - busy0) / (self.worker.threads * max(t1 - t0, 1e-9))

    def line(self) -> tuple[float, float] | None:
        """The pool's load as `fixed + marginal x sessions`, from the levels seen; None before any.

        One level: the line from the idle load through it (marginal = the average cost per session
        over the idle load). Several: the least-squares line through them, each weighted by its
        samples (at most LEVEL_WEIGHT_MAX), its slope kept between MARGINAL_FLOOR times the least
        average cost per session and the greatest (few or noisy levels can tilt a line; the
        average bounds it from above while what sessions share is part of it)."""
        if not self.levels:
            return None
        levels = list(self.levels.values())
        averages = [max(v.load - self.idle_load, 0.0) / v.sessions for v in levels]
        if len(levels) == 1:
            return self.idle_load, averages[0]
        n = np.array([v.sessions for v in levels])
        y = np.array([v.load for v in levels])
        w = np.minimum([v.samples for v in levels], LEVEL_WEIGHT_MAX).astype(np.float64)
        n_mean, y_mean = np.average(n, weights=w), np.average(y, weights=w)
        spread = float(np.sum(w * (n - n_mean) ** 2))
        slope = float(np.sum(w * (n - n_mean) * (y - y_mean)) / spread) if spread > 0 else max(averages)
        marginal = min(max(slope, MARGINAL_FLOOR * min(averages)), max(averages))
        return float(y_mean - marginal * n_mean), marginal

    def cost(self) -> float | None:
        """What one more session adds here: learnt (the line's slope), or bounded by an idle
        window; None before either."""
        line = self.line()
        return line[1] if line is not None else self.cost_bound

    def predict(self, sessions: int) -> float | None:
        """The load the levels seen say `sessions` connected keep this pool at; None before any."""
        line = self.line()
        return None if line is None else line[0] + line[1] * sessions


@dataclass(frozen=True)
class Forecast:
    """The input lag's p95 one more session would bring (`Admission.forecast`)."""

    p95_s: float
    pool: str  # the busiest pool with it
    load: float  # that pool's load with it
    scale_s: float  # the lag p95 at no load it goes by
    basis: str  # where that was measured


class Admission:
    def __init__(self, workers: Sequence[Pool], max_load: float, lag: InputLag | None = None, cold_start_sessions: int = 8,
                 clock: Callable[[], float] = time.monotonic, gil_threads: Sequence[int] = ()) -> None:
        self._clock = clock
        self.pools = [PoolLoad(w, clock) for w in workers]
        self.max_load = max_load
        self.lag = lag or InputLag(float("inf"), clock=clock)
        self.connected = Connected(clock)  # the numbers of sessions the two levels learn at
        self.late_levels = LateLevels(self.lag, self.connected, clock)
        self.lag_levels = LagLevels(self.lag, self.connected, clock)
        self._gil_threads = gil_threads  # besides the loop's: watched with it (`watch`)
        self.cold_start_sessions = cold_start_sessions
        self._admitted: deque[float] = deque(maxlen=ADMISSIONS_MAX)  # when each recent session was let in

    def watch_pool(self, worker: Pool) -> None:
        self.pools.append(PoolLoad(worker, self._clock))

    def sample(self, sessions: int) -> None:
        loads = [pool.sample(sessions) for pool in self.pools]
        self.connected.sample(sessions)
        self.late_levels.sample()
        self.lag_levels.sample(max(loads, default=0.0))

    def admitted(self) -> None:
        """A session was let in: until the window holds its load, it is counted at its pools' cost."""
        self._admitted.append(self._clock())

    def refuse(self, sessions: int) -> Refusal | None:
        """Why one more session does not fit (see the module doc), or None. The first always fits:
        it slows nobody."""
        if sessions == 0:
            return None
        late, pool, sessions_late = self.lag.late_share()
        if late > LATE_SHARE and sessions_late >= LATE_SESSIONS:
            return Refusal("input_lag", pool or "-", WINDOW_S,
                           f"{late:.0%} of the last {WINDOW_S:g} s of input was processed more than "
                           f"{self.lag.deadline_s:g} s late (pool {pool})")
        if (late_at := self.late_levels.limit()) is not None and sessions + 1 >= late_at[0]:
            return Refusal("input_lag", late_at[1], WINDOW_S,
                           f"the input was processed late with {late_at[0]} sessions connected; {sessions} are now")
        unmeasured = self._unmeasured()
        for p in self.pools:
            load, cost, full, name = p.load(), p.cost(), p.predict(sessions + 1), p.worker.name
            # The window must turn over before the load can have fallen: retry after it.
            if load > self.max_load or (full is not None and full > self.max_load):
                return Refusal("pool_load", name, WINDOW_S, f"one more session would overload {name}")
            if cost is None and unmeasured >= self.cold_start_sessions:
                return Refusal("cold_start", name, WINDOW_S, f"{unmeasured} sessions let in during the last {WINDOW_S:g} s "
                               f"are not measured yet on {name}, whose cost per session is not known yet")
            if cost is not None and load + (unmeasured + 1) * cost > self.max_load:
                return Refusal("pool_load", name, WINDOW_S, f"{unmeasured} sessions let in during the last {WINDOW_S:g} s "
                               f"are not measured yet on {name}; one more would overload it")
        # The forecast says nothing of a count the lag was never measured at but what the loads say,
        # and they see no cost paid in a burst's first seconds (a decoder built for each stream
        # beyond the recognizer's pool, a core another tenant holds): beyond the most sessions the
        # lag was measured with, the cold start's pace, so each step is measured before the next.
        measured = self.lag_levels.measured
        beyond = min(unmeasured, sessions - measured)
        if self.lag.deadline_s < float("inf") and beyond >= self.cold_start_sessions:
            return Refusal("cold_start", "-", WINDOW_S, f"{beyond} sessions let in during the last {WINDOW_S:g} s are beyond "
                           f"the {measured} the input lag was measured with; not measured yet")
        if (ahead := self.forecast(sessions)) is not None and ahead.p95_s > self.lag.deadline_s:
            return Refusal("input_lag_forecast", ahead.pool, WINDOW_S,
                           f"with {sessions + 1} sessions the input lag p95 would be {ahead.p95_s:.2f} s, past the "
                           f"{self.lag.deadline_s:g} s deadline: {ahead.pool} {ahead.load:.0%} busy, over the lag "
                           f"{ahead.basis}")
        return None

    def _unmeasured(self) -> int:
        """The sessions let in during the last window: their load is not all in it yet."""
        since = self._clock() - WINDOW_S
        return sum(1 for at in self._admitted if at >= since)

    def forecast(self, sessions: int) -> Forecast | None:
        """The input lag's p95 with one more session than `sessions` connected; None before a lag
        p95 (of at least LATE_SESSIONS sessions) and a pool's cost are measured.

        The input path is taken as a queue whose server is the busiest pool: the p95 of an M/M/1
        queue's time in system is -ln(0.05) x service time / (1 - load), so the lag p95 measured
        at a load gives the p95 at no load, `scale` = p95 x (1 - load), and the p95 at another
        load is scale / (1 - load). The scale is the greater of the lag levels' (lateness.py,
        LagLevels.scale) and the last window's, so far: the lag rising within a window raises
        it at once. The load with one more session is each pool's line at sessions + 1, or its load
        now with the sessions let in during the last window, whose load it does not hold yet, and
        this one at its marginal cost, whichever is more (as the pool_load rule counts them): a
        burst of connects faster than the samples that measure them counts in full. Nothing in it
        is fitted to a machine: the deadline is configured, the scale and the loads are measured."""
        scales = []
        if (learnt := self.lag_levels.scale()) is not None:
            scales.append((learnt[0], f"p95 learnt at {learnt[1]} sessions"))
        now_p95, now_load = self.lag.shared_p95(), max((p.load() for p in self.pools), default=0.0)
        if now_p95 is not None and now_load < 1:
            scales.append((now_p95 * (1 - now_load), f"p95 of the last {WINDOW_S:g} s ({now_p95:.3f} s at {now_load:.0%})"))
        if not scales:
            return None
        unmeasured, busiest = self._unmeasured(), None
        for p in self.pools:
            if (cost := p.cost()) is None:
                continue
            load = max(p.predict(sessions + 1) or 0.0, p.load() + (unmeasured + 1) * cost)
            if busiest is None or load > busiest[0]:
                busiest = (load, p.worker.name)
        if busiest is None:
            return None
        scale_s, basis = max(scales)
        load, pool = busiest
        return Forecast(scale_s / (1 - load) if load < 1 else float("inf"), pool, load, scale_s, basis)

    def lag_report(self, sessions: int) -> dict:
        """The forecast for one more session and the lag levels it learnt from, for /readyz."""
        ahead = self.forecast(sessions)
        return {"levels": self.lag_levels.report(), "measured_sessions": self.lag_levels.measured,
                "next_session": None if ahead is None else {
                    "p95_s": round(ahead.p95_s, 4), "pool": ahead.pool, "load": round(ahead.load, 3),
                    "scale_s": round(ahead.scale_s, 4), "basis": ahead.basis}}

    def report(self) -> dict[str, dict]:
        out = {}
        for p in self.pools:
            line = p.line()
            out[p.worker.name] = {
                "load": round(p.load(), 3), "threads": p.worker.threads, "idle_load": round(p.idle_load, 4),
                "fixed_load": None if line is None else round(line[0], 4),
                "marginal_cost": None if line is None else round(line[1], 4),
                "levels": {k: round(v.load, 3) for k, v in sorted(p.levels.items())}}
        return out

    async def watch(self, sessions: Callable[[], int], on_sample: Callable[[], None] = lambda: None) -> None:
        """Sample every SAMPLE_S until cancelled (runs on the event loop: a few float reads); the
        GIL's threads, the loop's own among them, are watched from here on."""
        self.watch_pool(GilThreads(self._gil_threads))
        while True:
            self.sample(sessions())
            on_sample()
            await asyncio.sleep(SAMPLE_S)
