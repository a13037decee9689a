"""Admission control for the thread pools: engines that cannot batch (pocketsphinx, espeak-ng, the
resampler and gate) and the VAD batcher.

Such an engine runs on a `Worker`, a fixed pool of threads (the VAD batcher, one thread, counts its
time the same way). Its load is the share of the pool's
thread-time spent running calls, measured over a sliding window. A pool near saturation delays
every session that uses it, all at once: the default config with 16 speakers gave no reply within
10 s and told nobody. So a new session is refused with `busy` and a retry-after instead, when
- a pool is above `limits.max_worker_load` now, or
- the pool's learnt cost per connected session (its load divided by the sessions connected, an
  average over time, so a session's pauses count) says one more would pass that limit. This second
  rule catches a burst of connections that have not started speaking yet.
Devices whose engines batch (the CosyVoice 2 scheduler) answer for themselves through
`Synthesizer.admit()`; both are asked.

Memory bound: per pool a window of WINDOW_S / SAMPLE_S samples (two floats each).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable, Protocol, Sequence

SAMPLE_S = 0.5
WINDOW_S = 5.0
# How fast the cost per session follows a new measurement (per sample): about 20 s to settle.
COST_EWMA = 0.025
# Below this load a pool's cost per session is too small to measure; it is not learnt from.
MIN_LOAD_TO_LEARN = 0.05


class Pool(Protocol):
    """What the load is read from: a Worker, or the VAD batcher."""

    name: str
    threads: int

    @property
    def busy_s(self) -> float: ...  # CPU seconds spent running calls since start


class PoolLoad:
    """One worker pool's load: busy thread-seconds / (threads x elapsed), over the last WINDOW_S."""

    def __init__(self, worker: Pool, clock: Callable[[], float] = time.monotonic) -> None:
        self.worker = worker
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=int(WINDOW_S / SAMPLE_S) + 1)
        self.cost_per_session: float | None = None  # learnt load of one connected session

    def sample(self, sessions: int) -> float:
        self._samples.append((self._clock(), self.worker.busy_s))
        load = self.load()
        if sessions and load >= MIN_LOAD_TO_LEARN:
            cost = load / sessions
            self.cost_per_session = cost if self.cost_per_session is None else (
                self.cost_per_session + COST_EWMA * (cost - self.cost_per_session))
        return load

    def load(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, busy0), (t1, busy1) = self._samples[0], self._samples[-1]
        return (busy1 - busy0) / (self.worker.threads * max(t1 - t0, 1e-9))


class Admission:
    def __init__(self, workers: Sequence[Pool], max_load: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.pools = [PoolLoad(w, clock) for w in workers]
        self.max_load = max_load

    def sample(self, sessions: int) -> None:
        for pool in self.pools:
            pool.sample(sessions)

    def refuse(self, sessions: int) -> tuple[str, float] | None:
        """(the pool that is full, retry after seconds) when one more session does not fit, else None."""
        for pool in self.pools:
            load = pool.load()
            with_one_more = load + (pool.cost_per_session or 0.0)
            learnt_total = (sessions + 1) * (pool.cost_per_session or 0.0)
            if load > self.max_load or max(with_one_more, learnt_total) > self.max_load:
                # The window must turn over before the load can have fallen.
                return pool.worker.name, WINDOW_S
        return None

    def report(self) -> dict[str, dict]:
        return {p.worker.name: {"load": round(p.load(), 3), "threads": p.worker.threads,
                                "cost_per_session": None if p.cost_per_session is None else round(p.cost_per_session, 4)}
                for p in self.pools}

    async def watch(self, sessions: Callable[[], int], on_sample: Callable[[], None] = lambda: None) -> None:
        """Sample every SAMPLE_S until cancelled (runs on the event loop: a few float reads)."""
        while True:
            self.sample(sessions())
            on_sample()
            await asyncio.sleep(SAMPLE_S)
