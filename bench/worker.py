"""The engine worker pool against concurrent.futures.ThreadPoolExecutor, side by side in one run.

What a session pays per engine call: `await worker.run(fn)` from the event loop, round trip, with
`--sessions` coroutines calling at once (each awaiting its own calls one at a time, as sessions do),
for a call that does nothing (the pool's own cost) and one that computes ~0.2 ms (a VAD window).
Prints p50 / p95 / p99 of the round trip and calls per second for each pool (median of `--repeats`
runs, alternated), and their ratio.

    .venv/bin/python bench/worker.py --calls 3000 --sessions 1 4 16 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from voicebot.serving.worker import Worker  # noqa: E402


class Executor:
    """ThreadPoolExecutor behind the same `run` (what serving/worker.py used before)."""

    def __init__(self, threads: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)

    async def run(self, fn, *args):
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    def shutdown(self) -> None:
        self._pool.shutdown()


def nothing() -> None:
    return None


WINDOW = np.random.default_rng(0).standard_normal(512).astype(np.float32)


def vad_like() -> float:
    total = 0.0
    for _ in range(20):
        total += float(np.abs(np.fft.rfft(WINDOW)).sum())
    return total


async def measure(pool, fn, calls: int, sessions: int) -> tuple[np.ndarray, float]:
    times: list[float] = []

    async def session(n: int) -> None:
        for _ in range(n):
            start = time.perf_counter()
            await pool.run(fn)
            times.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(session(calls // sessions) for _ in range(sessions)))
    return np.array(times) * 1000, len(times) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'call':>8} {'sessions':>8} {'pool':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'calls/s':>9}")
    makers = {"executor": Executor, "worker": lambda t: Worker("bench", threads=t)}
    for fn in (nothing, vad_like):
        for sessions in args.sessions:
            ms: dict[str, list[np.ndarray]] = {name: [] for name in makers}
            rates: dict[str, list[float]] = {name: [] for name in makers}
            for _ in range(args.repeats):  # alternated, so a busy moment of the machine hits both
                for name, make in makers.items():
                    pool = make(args.threads)
                    asyncio.run(measure(pool, fn, min(300, args.calls), sessions))  # warm-up: threads started
                    times, rate = asyncio.run(measure(pool, fn, args.calls, sessions))
                    pool.shutdown()
                    ms[name].append(times)
                    rates[name].append(rate)
            for name in makers:
                p50, p95, p99 = np.percentile(np.concatenate(ms[name]), [50, 95, 99])
                print(f"{fn.__name__:>8} {sessions:>8} {name:>9} {p50:8.3f} {p95:8.3f} {p99:8.3f} {np.median(rates[name]):9.0f}")
            ratio = np.median(rates["worker"]) / np.median(rates["executor"])
            print(f"{'':>8} {'':>8} {'ratio':>9} {'':>8} {'':>8} {'':>8} {ratio:9.2f}  (worker / executor, median of {args.repeats})")

if __name__ == "__main__":
    main()
