"""Requests from many sessions' streams, one model call per step, on a thread of its own.

The shape shared by the VAD batcher (voicebot/serving/vad.py: Silero windows) and the ASR batcher
(voicebot/asr/sanm/batcher.py: streaming Paraformer chunks). A session submits one request for its
stream and awaits its future; the thread answers it. A stream's pieces are sequential (its state
carries from one piece to the next), so one step takes the next piece of every request taken and
runs them as one model call; a request of k pieces takes part in k steps: it joins at the first
step after it arrives and leaves when its last piece is done. Nothing waits on purpose to fill a
batch: a step runs as soon as there is a piece, and what arrives while it runs joins the next one.

A subclass says what a request is and how a step runs, in four methods:
- `_take(request)`: on the thread, as the request is taken (a front end may run here, off the event
  loop); False when it has nothing to step (it is answered at once).
- `_call(requests)`: one model call for the next piece of each request, advancing each.
- `_done(request)`, `_result(request)`: whether it has pieces left; what its future gets.
- `_drop(request)`: a request that failed; its stream's state may be half-updated (the default
  leaves it; the ASR batcher starts the stream's utterance afresh).

Bounds (written down because every session waits here):
- at most `max_pending` requests waiting or running, one per stream at a time (so this bounds
  streams, each holding one call's input); `submit` past it raises the subclass's `overloaded`
  error (a `BatcherOverloaded`) and counts it in `refused`; nothing is queued for it.
- at most `max_batch` rows a step, oldest first; the rest wait for the next step.

Counted: `batch_sizes` (steps by rows), `refused` (submits over the bound), `cancelled` (requests
whose session went away before they were taken: their input is not run), `failed_requests`
(requests answered with an error: their step, their `_take`, a break of the loop or a stop), `thread_faults`
(BaseExceptions that are not Exceptions, and breaks of the loop, survived), `busy_s` (the thread's
CPU seconds, read by admission control, voicebot/serving/capacity.py, like a worker pool's).

Every session's stream waits on this one thread, so it outlives what is raised in it: a step that
raises fails only its rows, each with `StepFailed` naming the batcher, the rows and the cause; a
`_take` that raises fails only its request with that exception; anything that escapes the loop
between steps fails every request the thread had taken with the subclass's `fault` error (a
`BatcherFault`) and the loop goes on. Once stopped, every request still waiting fails with
`BatcherStopped`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

RequestT = TypeVar("RequestT")


class BatcherOverloaded(RuntimeError):
    """More requests are waiting than the batcher's bound (`max_pending`)."""


class BatcherFault(RuntimeError):
    """The batcher's loop was broken while it held this request; the loop goes on."""


class BatcherStopped(RuntimeError):
    """The batcher stopped before this request was answered."""


class StepFailed(RuntimeError):
    """The model call this request's piece was in raised; the other steps go on."""


@dataclass(eq=False)
class _Job(Generic[RequestT]):
    stream_id: int  # id() of the stream: one request in flight per stream
    request: RequestT
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class StepBatcher(Generic[RequestT]):
    threads = 1  # as admission control reads a pool
    overloaded: type[BatcherOverloaded] = BatcherOverloaded
    fault: type[BatcherFault] = BatcherFault

    def __init__(self, name: str, max_batch: int, max_pending: int) -> None:
        self.name = name  # as admission control, /readyz and the errors show it
        self.max_batch = max_batch
        self.max_pending = max_pending
        self.batch_sizes: Counter[int] = Counter()  # steps run, by rows in the model call
        self.refused = 0
        self.cancelled = 0
        self.failed_requests = 0
        self.thread_faults = 0
        self._busy_s = 0.0
        self._incoming: list[_Job[RequestT]] = []  # submitted, not yet taken by the thread
        self._held: set[_Job[RequestT]] = set()  # taken by the thread, not yet answered
        self._active: list[_Job[RequestT]] = []  # thread only: the jobs with pieces left, oldest first
        self._in_flight: set[int] = set()  # stream_id of every job waiting or running
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- what a subclass defines --------------------------------------------------------------

    def _take(self, request: RequestT) -> bool:
        return True

    def _call(self, requests: list[RequestT]) -> None:
        raise NotImplementedError

    def _done(self, request: RequestT) -> bool:
        raise NotImplementedError

    def _result(self, request: RequestT) -> Any:
        raise NotImplementedError

    def _drop(self, request: RequestT) -> None:
        pass

    # ---- the public side ----------------------------------------------------------------------

    @property
    def busy_s(self) -> float:
        """CPU seconds the thread spent taking requests and in model calls since start."""
        return self._busy_s

    @property
    def pending(self) -> int:
        """Requests waiting or running (one per stream)."""
        return len(self._in_flight)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def stats(self) -> dict:
        return {"pending": self.pending, "max_pending": self.max_pending, "max_batch": self.max_batch,
                "batch_sizes": dict(sorted(self.batch_sizes.items())), "refused": self.refused,
                "cancelled": self.cancelled, "failed_requests": self.failed_requests,
                "thread_faults": self.thread_faults}

    def _enqueue(self, stream: object, request: RequestT) -> concurrent.futures.Future:
        """Queue `request` for `stream`; any thread. Its future gets `_result(request)`."""
        job = _Job(id(stream), request)
        with self._cond:
            if self._stopping:
                raise BatcherStopped(f"the {self.name} batcher has stopped")
            if job.stream_id in self._in_flight:
                raise RuntimeError(f"{self.name}: a stream's input is run in order: one request per stream at a time")
            if len(self._in_flight) >= self.max_pending:
                self.refused += 1
                raise self.overloaded(f"{len(self._in_flight)} {self.name} requests waiting (bound {self.max_pending})")
            self._in_flight.add(job.stream_id)
            self._incoming.append(job)
            self._cond.notify()
        return job.future

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._loop():
                pass
        finally:  # stopped (or, past every guard, the thread is going): nobody may wait on it
            with self._cond:
                self._stopping = True
                waiting = [*self._held, *self._incoming]
                self._incoming = []
            for job in waiting:
                self._fail(job, BatcherStopped(f"the {self.name} batcher has stopped"))

    def _loop(self) -> bool:
        """Step until stopped (True), or until something escapes a step (False: every request the
        thread had taken has failed, and the caller loops again)."""
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._incoming or self._active):
                        self._cond.wait()
                    if self._stopping:
                        return True
                    self._held.update(self._incoming)
                    incoming, self._incoming = self._incoming, []
                self._active += self._running(incoming)
                rows = self._active[: self.max_batch]
                if rows:
                    self._step(rows)
                self._active = [job for job in self._active if job.future.running()]  # answered: gone
        except BaseException as exc:  # every session's stream waits on this thread
            self.thread_faults += 1
            log.error("%s batcher: its loop was broken (%s: %s); failing the %d requests it held and going on",
                      self.name, type(exc).__name__, exc, len(self._held), exc_info=exc)
            with self._cond:
                held = list(self._held)
            for job in held:
                self._drop(job.request)
                self._fail(job, self.fault(f"the {self.name} batcher was interrupted ({type(exc).__name__}: {exc})"))
            self._active = []
            return False

    def _running(self, incoming: list[_Job[RequestT]]) -> list[_Job[RequestT]]:
        """The jobs still wanted, marked running (a running future can no longer be cancelled), each
        taken. A session that went away cancelled its future: its input is not run."""
        running = []
        for job in incoming:
            if not job.future.set_running_or_notify_cancel():
                self.cancelled += 1
                self._finish(job, cancelled=True)
                continue
            start = time.thread_time()
            try:
                has_pieces = self._take(job.request)
            except Exception as exc:  # this request's input is bad: it fails, the others go on
                self._drop(job.request)
                self._finish(job, exc)
                continue
            finally:
                self._busy_s += time.thread_time() - start
            if has_pieces:
                running.append(job)
            else:
                self._finish(job)
        return running

    def _step(self, rows: list[_Job[RequestT]]) -> None:
        start = time.thread_time()
        try:
            self._call([job.request for job in rows])
        except BaseException as exc:  # a failing call must not leave its streams waiting forever
            log.exception("%s batcher: a model call of %d rows failed", self.name, len(rows))
            if not isinstance(exc, Exception):  # never re-raised: it must not reach the event loop
                self.thread_faults += 1
            error = StepFailed(f"the {self.name} model call of {len(rows)} rows failed ({type(exc).__name__}: {exc})")
            error.__cause__ = exc
            for job in rows:
                self._drop(job.request)
                self._finish(job, error)
            return
        finally:
            self._busy_s += time.thread_time() - start
        self.batch_sizes[len(rows)] += 1
        for job in rows:
            if self._done(job.request):
                self._finish(job)

    def _fail(self, job: _Job[RequestT], error: Exception) -> None:
        """Answer a job the thread may or may not have marked running with `error` (not if its
        session cancelled it, nor if it was answered already)."""
        if job.future.done():
            return self._finish(job, cancelled=True)  # only forgotten
        if not job.future.running() and not job.future.set_running_or_notify_cancel():
            self.cancelled += 1
            return self._finish(job, cancelled=True)
        self._finish(job, error)

    def _finish(self, job: _Job[RequestT], error: BaseException | None = None, cancelled: bool = False) -> None:
        with self._cond:
            self._in_flight.discard(job.stream_id)
            self._held.discard(job)
        if cancelled:
            return
        if error is None:
            job.future.set_result(self._result(job.request))
        else:
            self.failed_requests += 1
            job.future.set_exception(error)
