"""Silero VAD windows of every session in one onnxruntime call.

Sessions submit the windows of their latest chunk (`submit`, `probabilities`) and await their
speech probabilities; a thread of its own runs them. Not the audio worker: that pool's threads each
run one session's front end (resample, echo canceller, gate), so a batch gathered there could hold
at most as many sessions as it has threads, and a thread waiting for others to join would hold one
of them idle. Here one thread takes whatever is waiting from every session.

A stream's windows are sequential (its recurrent state carries from one window to the next), so
one step takes the next window of each stream waiting, in one `silero_step` call; a stream whose
chunk held k windows takes part in k steps, joins at the first step after it arrives and leaves
when its last window is judged. Nothing waits on purpose to fill a batch: a step runs as soon as
there is a window, and what arrives while it runs joins the next one (one stream alone gets the
per-stream call). Each stream keeps its own state, so its probabilities do not depend on who else
is in the batch (tests/serving/test_vad.py).

Bounds: at most `max_pending` requests are waiting or running (a stream has one in flight at a
time, so this bounds streams; each holds one chunk's windows, at most protocol.MAX_CHUNK_SECONDS of
16 kHz float32); `submit` raises `VadOverloaded` past it. A step takes at most `max_batch` rows,
oldest first; the rest wait for the next step.

It counts its thread's CPU seconds (`busy_s`) as a `Worker` does, so admission control
(voicebot/serving/capacity.py) reads its load like any pool's.

Every session's endpointing waits on this one thread, so it outlives what is raised in it, as the
device scheduler does: a step that raises fails only its rows (what is not an `Exception`, such as
SystemExit or an exception raised into the thread, as `JobAborted`); anything that escapes the loop
between steps fails every request the thread had taken (`VadFault`) and the loop goes on. Both are
counted (`thread_faults`, voicebot_vad_thread_faults_total).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from voicebot.serving.silero import SileroVad, silero_session, silero_step
from voicebot.serving.worker import JobAborted

log = logging.getLogger(__name__)

# What a client refused with VadOverloaded is told (retry_after_s): the batcher drains in steps of
# milliseconds, so the client may send again soon.
VAD_RETRY_AFTER_S = 1


class VadOverloaded(RuntimeError):
    """More VAD requests are waiting than the batcher's bound."""


class VadFault(RuntimeError):
    """The batcher's loop was broken while it held this request; the loop goes on."""


@dataclass(eq=False)
class _Request:
    vad: SileroVad
    windows: np.ndarray  # (k, WINDOW)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    probabilities: np.ndarray = field(init=False)
    judged: int = 0  # windows done so far

    def __post_init__(self) -> None:
        self.probabilities = np.zeros(len(self.windows), np.float32)


class VadBatcher:
    name = "vad"
    threads = 1

    def __init__(self, max_batch: int = 64, max_pending: int = 1024) -> None:
        self.max_batch = max_batch
        self.max_pending = max_pending
        self.batch_sizes: Counter[int] = Counter()  # rows per onnxruntime call
        self.thread_faults = 0  # BaseExceptions that were not Exceptions, and breaks of the loop, survived
        self._busy_s = 0.0
        self._incoming: list[_Request] = []
        self._held: set[_Request] = set()  # taken by the thread, not yet answered
        self._active: list[_Request] = []  # thread only: the requests with windows to judge, oldest first
        self._in_flight: set[int] = set()  # id() of each stream with a request waiting or running
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def busy_s(self) -> float:
        """CPU seconds the thread spent in onnxruntime calls since start."""
        return self._busy_s

    @property
    def pending(self) -> int:
        return len(self._in_flight)

    def start(self) -> None:
        silero_session()  # load the graph before the first session needs it
        self._thread = threading.Thread(target=self._run, name="vad-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def submit(self, vad: SileroVad, windows: np.ndarray) -> concurrent.futures.Future:
        """The speech probability of each of one stream's windows (k, WINDOW), in order; any thread."""
        request = _Request(vad, windows)
        if not len(windows):
            request.future.set_result(request.probabilities)
            return request.future
        with self._cond:
            if self._stopping:
                raise RuntimeError("the VAD batcher has stopped")
            if id(vad) in self._in_flight:
                raise RuntimeError("a stream's windows are judged in order: one request per stream at a time")
            if len(self._in_flight) >= self.max_pending:
                raise VadOverloaded(f"{len(self._in_flight)} VAD requests waiting (bound {self.max_pending})")
            self._in_flight.add(id(vad))
            self._incoming.append(request)
            self._cond.notify()
        return request.future

    async def probabilities(self, vad: SileroVad, windows: np.ndarray) -> np.ndarray:
        return await asyncio.wrap_future(self.submit(vad, windows))

    def stats(self) -> dict:
        return {"pending": self.pending, "max_batch": self.max_batch, "batch_sizes": dict(sorted(self.batch_sizes.items())),
                "thread_faults": self.thread_faults}

    def _run(self) -> None:
        try:
            while not self._loop():
                pass
        finally:  # stopped (or, past every guard, the thread is going): nobody may wait on it
            with self._cond:
                self._stopping = True
                waiting = [*self._held, *self._incoming]
                self._incoming = []
            for request in waiting:
                self._fail(request, RuntimeError("the VAD batcher has stopped"))

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
                self._active = [r for r in self._active if r.judged < len(r.windows)]
        except BaseException as exc:  # every session's endpointing waits on this thread
            self.thread_faults += 1
            log.error("VAD batcher: its loop was broken (%s: %s); failing the %d requests it held and going on",
                      type(exc).__name__, exc, len(self._held), exc_info=exc)
            with self._cond:
                held = list(self._held)
            for request in held:
                self._fail(request, VadFault(f"the VAD batcher was interrupted ({type(exc).__name__}: {exc})"))
            self._active = []
            return False

    def _running(self, incoming: list[_Request]) -> list[_Request]:
        """The requests still wanted, marked running (a running future can no longer be cancelled).
        A session that went away cancelled its future (asyncio.wrap_future passes the cancel on):
        its windows are not judged."""
        running = []
        for request in incoming:
            if request.future.set_running_or_notify_cancel():
                running.append(request)
            else:
                self._finish(request, cancelled=True)
        return running

    def _step(self, rows: list[_Request]) -> None:
        start = time.thread_time()
        try:
            probabilities = silero_step([r.vad for r in rows], np.stack([r.windows[r.judged] for r in rows]))
        except BaseException as exc:  # a failing call must not leave its streams waiting forever
            log.exception("VAD batch of %d failed", len(rows))
            if not isinstance(exc, Exception):  # must never reach the event loop
                self.thread_faults += 1
                exc = JobAborted(f"{type(exc).__name__}: {exc}")
            for request in rows:
                request.judged = len(request.windows)
                self._finish(request, exc)
            return
        finally:
            self._busy_s += time.thread_time() - start
        self.batch_sizes[len(rows)] += 1
        for request, probability in zip(rows, probabilities):
            request.probabilities[request.judged] = probability
            request.judged += 1
            if request.judged == len(request.windows):
                self._finish(request)

    def _fail(self, request: _Request, error: Exception) -> None:
        """Answer a request the thread may or may not have marked running with `error` (not if its
        session cancelled it, nor if it was answered already)."""
        future = request.future
        if future.done():
            return self._finish(request, cancelled=True)  # only forgotten
        if not future.running() and not future.set_running_or_notify_cancel():
            return self._finish(request, cancelled=True)
        self._finish(request, error)

    def _finish(self, request: _Request, error: Exception | None = None, cancelled: bool = False) -> None:
        with self._cond:
            self._in_flight.discard(id(request.vad))
            self._held.discard(request)
        if cancelled:
            return
        if error is None:
            request.future.set_result(request.probabilities)
        else:
            request.future.set_exception(error)
