"""What the listener feels: how far behind the wall clock each session's input is processed (its
input lag), and how many sessions connected the input was late at before (`LateLevels`), for
admission control (voicebot/serving/capacity.py).

A chunk's input lag is the time from its arrival to the end of its trip: through the front end and
the VAD (the input clock, voicebot/serving/input_clock.py), the endpoint rule and the recognizer's
feed (voicebot/session/listening.py). It is late past the deadline (`limits.max_input_lag_s`).

The input is late in a window when more than LATE_SHARE of its chunks were late, in at least
LATE_SESSIONS sessions (one late session alone is its own matter: its decoding process restarting,
its client sending a backlog at once). What makes it late need not show in any pool's CPU load: the
main process's threads take turns holding one GIL, and on a shared box its holder can be
descheduled with it, so a burst of every session's chunks waits though every pool has room.
`LateLevels` remembers the most sessions connected during each whole window the input was late in
(the most, not the mean: as sessions leave, the window still holds the lateness of when they were
there, and a limit learnt then would be too low), so that admission does not let a burst of connects back up to it (each of those windows is an
experiment the listeners already paid for): a level is forgotten once a whole window at that many
sessions or more is on time (the box had room again: another tenant's load gone), or after
LATE_MEMORY_S without being late again, when one more session may try it.

`LagLevels` learns, for admission's forecast (capacity.py, `Admission.forecast`), the lag's p95 over
whole windows per number of sessions connected, with the busiest pool's load over the same window:
a burst of connects is refused at the count the forecast puts past the deadline, before any window
is late. And the most sessions connected throughout a window whose lag was measured: beyond it, a
burst goes at admission's cold-start pace.

Memory bound: per pool at most LAG_SAMPLES_MAX (time, lag, session) triples; the late levels and the
lag levels at most one per number of sessions (max_sessions bounds them); the counts connected over
the last WINDOW_S, one per sample (10 at the 0.5 s a sample of capacity.py).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

WINDOW_S = 5.0
# The input is late when more than this share of the window's chunks were: its p95 past the deadline.
LATE_SHARE = 0.05
# ... in at least this many sessions (see the module doc).
LATE_SESSIONS = 2
# A pool's lag window: 24 sessions' 20 ms chunks for 5 s is 6,000.
LAG_SAMPLES_MAX = 8192
# A number of sessions the input was late at is held as the limit this long after it was last late;
# a lag level (`LagLevels`) weighs in the forecast as long after it was last seen.
LATE_MEMORY_S = 60.0
# How fast a lag level follows a new window (per sample, 0.5 s): about 20 s to settle, as the pools'
# levels (capacity.py's COST_EWMA).
LAG_EWMA = 0.025


class InputLag:
    """Each chunk's input lag, per pool (the decoding pool its session's recognizer stream is bound
    to), over the last WINDOW_S: for admission and /readyz; every observation also goes to the
    histogram and the deadline misses to the counter, when given (voicebot/metrics.py)."""

    def __init__(self, deadline_s: float, histogram=None, misses=None, clock: Callable[[], float] = time.monotonic) -> None:
        self.deadline_s = deadline_s
        self._histogram = histogram
        self._misses = misses
        self._clock = clock
        # (when, lag, which session) of each chunk, per pool
        self._lags: defaultdict[str, deque[tuple[float, float, str]]] = defaultdict(lambda: deque(maxlen=LAG_SAMPLES_MAX))
        self.misses: defaultdict[str, int] = defaultdict(int)  # since start

    def observe(self, pool: str, session: str, lags: Iterable[float]) -> None:
        now, window = self._clock(), self._lags[pool]
        for lag in lags:
            window.append((now, lag, session))
            if self._histogram is not None:
                self._histogram.labels(pool).observe(lag)
            if lag > self.deadline_s:
                self.misses[pool] += 1
                if self._misses is not None:
                    self._misses.labels(pool).inc()

    def recent(self, pool: str) -> np.ndarray:
        """The lags of the last WINDOW_S of one pool."""
        since = self._clock() - WINDOW_S
        return np.array([lag for at, lag, _ in self._lags[pool] if at >= since], np.float64)

    def late_share(self) -> tuple[float, str | None, int]:
        """The share of the window's chunks past the deadline, the pool with the most of them, and
        how many sessions had one."""
        since = self._clock() - WINDOW_S
        worst, most, late_all, count_all, sessions = None, 0, 0, 0, set()
        for pool in list(self._lags):
            late = 0
            for at, lag, session in self._lags[pool]:
                if at >= since:
                    count_all += 1
                    if lag > self.deadline_s:
                        late += 1
                        sessions.add(session)
            late_all += late
            if late > most:
                worst, most = pool, late
        return (late_all / count_all if count_all else 0.0), worst, len(sessions)

    def shared_p95(self) -> float | None:
        """The lag p95 over the last WINDOW_S that LATE_SESSIONS sessions reached: each session's own
        p95, the LATE_SESSIONS-th highest (one session late alone is its own matter, as in
        late_share); None with fewer sessions in the window."""
        since = self._clock() - WINDOW_S
        by_session: defaultdict[str, list[float]] = defaultdict(list)
        for pool in list(self._lags):
            for at, lag, session in self._lags[pool]:
                if at >= since:
                    by_session[session].append(lag)
        if len(by_session) < LATE_SESSIONS:
            return None
        return sorted((float(np.percentile(lags, 95)) for lags in by_session.values()), reverse=True)[LATE_SESSIONS - 1]

    def report(self) -> dict[str, dict]:
        out = {}
        for pool in sorted(self._lags):
            lags = self.recent(pool)
            out[pool] = {"chunks": len(lags), "deadline_misses": self.misses[pool],
                         **({"p50_s": round(float(np.percentile(lags, 50)), 4), "p95_s": round(float(np.percentile(lags, 95)), 4)}
                            if len(lags) else {"p50_s": None, "p95_s": None})}
        return out


class Connected:
    """The numbers of sessions connected over the last WINDOW_S, one per sample, and since when some
    have been: the levels below learn only from a whole window with sessions in it (a session's
    start-up, or a window mostly empty, says nothing of what that many cost). One for both levels,
    sampled by admission before them (capacity.py, Admission.sample). Bound: a window of samples."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._counts: deque[tuple[float, int]] = deque()  # (when, sessions)
        self._since: float | None = None  # when the sessions connected last went from none to some
        self.whole = False  # some have been connected for a whole window, as of the last sample

    def sample(self, sessions: int) -> None:
        """Count them now."""
        now = self._clock()
        self._counts.append((now, sessions))
        while self._counts[0][0] < now - WINDOW_S:
            self._counts.popleft()
        self._since = None if not sessions else now if self._since is None else self._since
        self.whole = self._since is not None and self._since <= now - WINDOW_S

    def most(self) -> int:
        return max(n for _, n in self._counts)

    def least(self) -> int:
        return min(n for _, n in self._counts)


class LateLevels:
    """The numbers of sessions connected over whole windows the input was late in (see the module
    doc), and when each was last late."""

    def __init__(self, lag: InputLag, connected: Connected, clock: Callable[[], float] = time.monotonic) -> None:
        self.lag = lag
        self._clock = clock
        self._connected = connected
        self.late: dict[int, tuple[float, str]] = {}  # sessions -> (when last late, the pool most late)

    def sample(self) -> None:
        """Learn from the last window (`connected` sampled just before)."""
        if not self._connected.whole:
            return  # not a whole window with sessions in it yet
        # The most connected in the window: its late chunks may be from before some left.
        level = self._connected.most()
        share, pool, sessions_late = self.lag.late_share()
        if share > LATE_SHARE and sessions_late >= LATE_SESSIONS:
            self.late[level] = (self._clock(), pool or "-")
        elif share <= LATE_SHARE:
            for known in [k for k in self.late if k <= level]:
                del self.late[known]  # on time with as many or more: room again

    def limit(self) -> tuple[int, str] | None:
        """The least number of sessions the input was late at (within LATE_MEMORY_S), and the pool
        most late then; None when there is none."""
        since = self._clock() - LATE_MEMORY_S
        recent = [(level, pool) for level, (at, pool) in self.late.items() if at >= since]
        return min(recent) if recent else None

    def report(self) -> dict[str, float]:
        """{sessions: seconds since the input was last late at that many}, for /readyz."""
        now = self._clock()
        return {str(level): round(now - at, 1) for level, (at, _) in sorted(self.late.items())}


@dataclass
class LagLevel:
    """The input lag's p95 (`InputLag.shared_p95`) and the busiest pool's load, over the whole windows
    whose most connected was a number of sessions (`LagLevels`): the plain mean of the first
    1 / LAG_EWMA, then an EWMA; and when last learnt."""

    p95_s: float
    load: float
    seen: float
    samples: int = 1

    def add(self, p95_s: float, load: float, now: float) -> None:
        self.samples += 1
        weight = max(1 / self.samples, LAG_EWMA)
        self.p95_s += weight * (p95_s - self.p95_s)
        self.load += weight * (load - self.load)
        self.seen = now

    @property
    def scale_s(self) -> float:
        """The lag p95 as a queue's at no load: p95 x (1 - load) (see capacity.py, Admission.forecast)."""
        return self.p95_s * (1 - self.load)


class LagLevels:
    """The input lag's p95 per number of sessions connected, with the busiest pool's load over the
    same window, for admission's forecast. Learnt only from a window whose count varied by at most
    one (one joining or leaving), at its most: a p95 is a tail and a load a mean, so a window
    across a change (eight late, then four on time) would pair the tail of the one with the mean
    of both, a lag too high for a load too low."""

    def __init__(self, lag: InputLag, connected: Connected, clock: Callable[[], float] = time.monotonic) -> None:
        self.lag = lag
        self._clock = clock
        self._connected = connected
        self.levels: dict[int, LagLevel] = {}
        # The most sessions connected throughout a whole window whose lag was measured (steady or
        # not): admission's cold start paces a burst beyond it.
        self.measured = 0

    def sample(self, busiest_load: float) -> None:
        """Learn from the last window (`connected` sampled just before): the lag's p95 and
        `busiest_load`, the most any pool was busy over it. Not from a pool full (load 1: a queue
        that grows has no p95 to learn from)."""
        if not self._connected.whole:
            return
        if (p95 := self.lag.shared_p95()) is None:
            return  # fewer than LATE_SESSIONS sessions sent audio
        self.measured = max(self.measured, self._connected.least())
        if busiest_load >= 1 or self._connected.most() - self._connected.least() > 1:
            return
        now, key = self._clock(), self._connected.most()
        if key in self.levels:
            self.levels[key].add(p95, busiest_load, now)
        else:
            self.levels[key] = LagLevel(p95, busiest_load, now)

    def scale(self) -> tuple[float, int] | None:
        """The greatest `scale_s` of the levels learnt within LATE_MEMORY_S (the bound the forecast
        goes by where its queue is rough), else the most recently learnt level's, and the number of
        sessions it was learnt at; None before any. A level kept from being seen again by the limit
        it sets (another tenant's load, since gone) weighs only LATE_MEMORY_S: then the levels
        learnt since, nearer that limit, say whether one more fits."""
        if not self.levels:
            return None
        since = self._clock() - LATE_MEMORY_S
        recent = [(v.scale_s, n) for n, v in self.levels.items() if v.seen >= since]
        if recent:
            return max(recent)
        n, level = max(self.levels.items(), key=lambda item: item[1].seen)
        return level.scale_s, n

    def report(self) -> dict[str, dict[str, float]]:
        """{sessions: {p95_s, load, seen_s_ago}}, for /readyz."""
        now = self._clock()
        return {str(n): {"p95_s": round(v.p95_s, 4), "load": round(v.load, 3), "seen_s_ago": round(now - v.seen, 1)}
                for n, v in sorted(self.levels.items())}
