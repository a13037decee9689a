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

from voicebot.audio.endpoint import SileroVad, silero_session, silero_step

log = logging.getLogger(__name__)


class VadOverloaded(RuntimeError):
    """More VAD requests are waiting than the batcher's bound."""


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
        self._busy_s = 0.0
        self._incoming: list[_Request] = []
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
        return {"pending": self.pending, "max_batch": self.max_batch, "batch_sizes": dict(sorted(self.batch_sizes.items()))}

    def _run(self) -> None:
        active: list[_Request] = []
        while True:
            with self._cond:
                while not (self._stopping or self._incoming or active):
                    self._cond.wait()
                if self._stopping:
                    break
                incoming, self._incoming = self._incoming, []
            active += self._running(incoming)
            if not active:
                continue
            rows = active[: self.max_batch]
            try:
                self._step(rows)
            except Exception as exc:  # a failing call must not leave its streams waiting forever
                log.exception("VAD batch of %d failed", len(rows))
                for request in rows:
                    request.judged = len(request.windows)
                    self._finish(request, exc)
            active = [r for r in active if r.judged < len(r.windows)]
        for request in active + self._running(self._incoming):
            self._finish(request, RuntimeError("the VAD batcher has stopped"))

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
        finally:
            self._busy_s += time.thread_time() - start
        self.batch_sizes[len(rows)] += 1
        for request, probability in zip(rows, probabilities):
            request.probabilities[request.judged] = probability
            request.judged += 1
            if request.judged == len(request.windows):
                self._finish(request)

    def _finish(self, request: _Request, error: Exception | None = None, cancelled: bool = False) -> None:
        with self._cond:
            self._in_flight.discard(id(request.vad))
        if cancelled:
            return
        if error is None:
            request.future.set_result(request.probabilities)
        else:
            request.future.set_exception(error)
