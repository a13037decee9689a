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

Memory bound: per pool at most LAG_SAMPLES_MAX (time, lag, session) triples; the late levels at most
one per number of sessions (max_sessions bounds them).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import Callable, Iterable

import numpy as np

WINDOW_S = 5.0
# The input is late when more than this share of the window's chunks were: its p95 past the deadline.
LATE_SHARE = 0.05
# ... in at least this many sessions (see the module doc).
LATE_SESSIONS = 2
# A pool's lag window: 24 sessions' 20 ms chunks for 5 s is 6,000.
LAG_SAMPLES_MAX = 8192
# A number of sessions the input was late at is held as the limit this long after it was last late.
LATE_MEMORY_S = 60.0


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

    def report(self) -> dict[str, dict]:
        out = {}
        for pool in sorted(self._lags):
            lags = self.recent(pool)
            out[pool] = {"chunks": len(lags), "deadline_misses": self.misses[pool],
                         **({"p50_s": round(float(np.percentile(lags, 50)), 4), "p95_s": round(float(np.percentile(lags, 95)), 4)}
                            if len(lags) else {"p50_s": None, "p95_s": None})}
        return out


class LateLevels:
    """The numbers of sessions connected over whole windows the input was late in (see the module
    doc), and when each was last late."""

    def __init__(self, lag: InputLag, clock: Callable[[], float] = time.monotonic) -> None:
        self.lag = lag
        self._clock = clock
        self._connected: deque[tuple[float, int]] = deque()  # (when, sessions) over the last WINDOW_S
        self._sessions_since: float | None = None  # when the sessions connected last went from none to some
        self.late: dict[int, tuple[float, str]] = {}  # sessions -> (when last late, the pool most late)

    def sample(self, sessions: int) -> None:
        now = self._clock()
        self._connected.append((now, sessions))
        while self._connected[0][0] < now - WINDOW_S:
            self._connected.popleft()
        if not sessions:
            self._sessions_since = None
            return
        self._sessions_since = now if self._sessions_since is None else self._sessions_since
        if self._sessions_since > now - WINDOW_S:
            return  # not a whole window with sessions in it yet
        # The most connected in the window: its late chunks may be from before some left.
        level = max(n for _, n in self._connected)
        share, pool, sessions_late = self.lag.late_share()
        if share > LATE_SHARE and sessions_late >= LATE_SESSIONS:
            self.late[level] = (now, pool or "-")
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
