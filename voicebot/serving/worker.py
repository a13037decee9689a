"""Model work off the event loop.

Blocking model code (PyTorch, onnxruntime, pocketsphinx, espeak) never runs inside a coroutine.
Each engine owns a `Worker`: a small fixed pool of threads fed by one FIFO queue. A session awaits
`worker.run(fn, ...)`; the loop stays free to move bytes for every other session. Engines that
stream (one LM step, one flow chunk) submit one small call per step, so the calls of many
sessions interleave on the same thread instead of one long reply holding it.

`threads=1` is the right setting for an engine that is not thread-safe (funasr's AutoModel,
espeak-ng's global state) or that already uses every core itself (torch intra-op threads).

A worker outlives its calls' faults, because an engine that fails once must not take a show down:
- a call that raises anything at all fails only its own future; what is not an `Exception`
  (SystemExit from a library's exit(), an asynchronous exception) arrives as `JobAborted`, since
  a BaseException reaching the event loop would stop the server;
- a thread that dies anyway (an exception between calls) is replaced at once; the call it had
  taken but not begun runs on its replacement, one it was running fails with `WorkerThreadLost`.
  So no call waits for a thread that is gone. `threads_lost` counts them (voicebot_worker_threads_lost_total).

Why not concurrent.futures.ThreadPoolExecutor: a thread of its pool that dies takes the call in
its hands with it (that future never completes) and is never replaced.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections import deque
from itertools import count
from typing import Any, Callable, TypeVar

T = TypeVar("T")

log = logging.getLogger("voicebot.worker")


class JobAborted(RuntimeError):
    """A call ended by a BaseException that is not an Exception."""


class WorkerThreadLost(RuntimeError):
    """The thread running a call died before the call returned."""


class _Job:
    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.begun = False

    def run(self) -> float:
        """Run the call into its future; never raises. Returns the CPU seconds it took."""
        self.begun = True  # first: a thread dying from here on must not hand the call to another
        if not self.future.set_running_or_notify_cancel():
            return 0.0  # cancelled while queued
        start = time.thread_time()
        try:
            result = self.call()
        except Exception as exc:  # noqa: BLE001 -- the caller's to handle, in its coroutine
            self.future.set_exception(exc)
        except BaseException as exc:  # noqa: BLE001 -- must never reach the event loop
            self.future.set_exception(JobAborted(f"{type(exc).__name__}: {exc}"))
        else:
            self.future.set_result(result)
        return time.thread_time() - start


class Worker:
    def __init__(self, name: str, threads: int = 1) -> None:
        self.name = name
        self.threads = threads
        # Unbounded like any executor's queue: the callers bound it, each session awaiting its
        # own calls one at a time (at most a few per session: max_sessions bounds the sessions).
        # None: a thread's end (shutdown).
        self._jobs: deque[_Job | None] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # a job was queued
        self._live: set[threading.Thread] = set()
        self._names = count()
        self._closed = False
        self._pending = 0
        self._busy_s = 0.0
        self.threads_lost = 0

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
        job = _Job(functools.partial(fn, *args, **kwargs))
        job.future.add_done_callback(self._done)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"worker {self.name} is shut down")
            self._pending += 1
            self._start_threads()
            self._jobs.append(job)
            self._ready.notify()
        return job.future

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def _start_threads(self) -> None:
        """Up to `threads` live threads (called with the lock held)."""
        while len(self._live) < self.threads:
            thread = threading.Thread(target=self._serve, name=f"worker-{self.name}_{next(self._names)}", daemon=True)
            self._live.add(thread)
            thread.start()

    def _serve(self) -> None:
        job, busy = None, 0.0
        try:
            while True:
                with self._ready:
                    self._busy_s += busy  # the last call's, counted with the lock this takes anyway
                    while not self._jobs:
                        self._ready.wait()
                    # Looked at, then taken: a thread that dies between the two leaves it queued.
                    job = self._jobs[0]
                    self._jobs.popleft()
                if job is None:
                    return
                busy = job.run()
                job = None
        finally:
            with self._lock:
                self._live.discard(threading.current_thread())
                died = not self._closed or (job is not None and not job.future.done())
            if died:
                self._lost(job)

    def _lost(self, job: _Job | None) -> None:
        """This thread is dying (called on it): replace it, and settle the call it had."""
        log.error("worker %s lost a thread (%s); starting another", self.name, threading.current_thread().name)
        if job is not None and job.begun and not job.future.done():
            job.future.set_exception(WorkerThreadLost(f"worker {self.name}'s thread died during this call"))
        with self._lock:
            self.threads_lost += 1
            requeue = job is not None and not job.begun and job not in self._jobs
            if not self._closed:
                if requeue:
                    self._jobs.appendleft(job)  # taken, never begun: first in line again
                self._start_threads()
                return
        if requeue:
            job.future.cancel()  # shut down meanwhile: as every queued call

    def _done(self, _future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self) -> None:
        """Cancel queued calls; each thread ends after the call it is running."""
        with self._lock:
            self._closed = True
            queued = [job for job in self._jobs if job is not None]
            self._jobs.clear()
            self._jobs.extend([None] * len(self._live))
            self._ready.notify_all()
        for job in queued:
            job.future.cancel()
