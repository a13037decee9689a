"""Model work off the event loop.

Blocking model code (PyTorch, onnxruntime, pocketsphinx, espeak) never runs inside a coroutine.
Each engine owns a `Worker`: a small fixed pool of threads fed by one FIFO queue. A session awaits
`worker.run(fn, ...)`; the loop stays free to move bytes for every other session. Engines that
stream (one LM step, one flow chunk) submit one small call per step, so the calls of many
sessions interleave on the same thread instead of one long reply holding it.

`threads=1` is the right setting for an engine that is not thread-safe (funasr's AutoModel,
espeak-ng's global state) or that already uses every core itself (torch intra-op threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Worker:
    def __init__(self, name: str, threads: int = 1) -> None:
        self.name = name
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"worker-{name}")
        self._pending = 0
        self._busy_s = 0.0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Calls queued or running: a gauge of how far behind this engine is."""
        return self._pending

    @property
    def busy_s(self) -> float:
        """CPU seconds the pool's threads spent running calls since start. CPU time, not wall time:
        a call that waits for a core other work holds costs what it computes, so the admission
        control (voicebot/serving/capacity.py) reads its growth as this pool's own load."""
        return self._busy_s

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        with self._lock:
            self._pending += 1
        future = self._pool.submit(self._timed, functools.partial(fn, *args, **kwargs))
        future.add_done_callback(self._done)
        return future

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def _timed(self, call: Callable[[], T]) -> T:
        start = time.thread_time()
        try:
            return call()
        finally:
            elapsed = time.thread_time() - start
            with self._lock:
                self._busy_s += elapsed

    def _done(self, _future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
