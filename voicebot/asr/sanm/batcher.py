"""Every session's streaming Paraformer chunks in one model call per step, on a thread of its own.

Sessions submit audio for their stream (`submit`, `feed`) and await the tokens it produced; one
thread runs the model. A stream's pieces are sequential (its caches carry from one to the next),
so a step takes the next piece (one chunk stride, 600 ms for [0, 10, 5]) of each stream waiting,
in one `StreamingParaformer.step`: one encoder call and one decoder call for all of them. A stream
whose request held k pieces takes part in k steps: it joins at the first step after it arrives and
leaves when its last piece is decoded. Nothing waits on purpose to fill a batch: a step runs as soon
as there is a piece, and what arrives while it runs joins the next one. Each stream keeps its own
state, so its tokens do not depend on who else is in the batch (tests/asr/test_sanm_batch.py).

The front end (fbank, LFR, CMVN) of a request runs on this thread when the request is taken, not on
the caller's (the event loop's) thread.

Bounds: at most `max_pending` requests are waiting or running (one per stream at a time, so this
bounds streams; each holds the audio of one call); `submit` raises `AsrOverloaded` past it. A step
takes at most `max_batch` rows, oldest first; the rest wait for the next step.

A step that raises fails only its rows, and their streams start a new utterance (their state may
be half-updated; the utterance's audio so far is lost and the error says so); what is not an
`Exception` (SystemExit, an exception raised into the thread) becomes `JobAborted`. Anything that
escapes the loop between steps fails every request the thread had taken (`AsrBatcherFault`) and the
loop goes on. Both are counted (`thread_faults`).
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

from voicebot.asr.sanm.stream import Decoded, ParaformerStream, Piece, StreamingParaformer
from voicebot.serving.worker import JobAborted

log = logging.getLogger(__name__)


class AsrOverloaded(RuntimeError):
    """More recognition requests are waiting than the batcher's bound."""


class AsrBatcherFault(RuntimeError):
    """The batcher's loop was broken while it held this request; the loop goes on."""


@dataclass(eq=False)
class _Request:
    stream: ParaformerStream
    audio: np.ndarray
    is_final: bool
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    pieces: list[Piece] = field(default_factory=list)
    result: Decoded = field(default_factory=Decoded)


class ParaformerBatcher:
    threads = 1

    def __init__(self, engine: StreamingParaformer, max_batch: int = 32, max_pending: int = 1024,
                 name: str = "asr") -> None:
        self.name = name  # as admission control and /readyz show it
        self.engine = engine
        self.max_batch = max_batch
        self.max_pending = max_pending
        self.batch_sizes: Counter[int] = Counter()  # rows per model call
        self.thread_faults = 0
        self.failed_utterances = 0  # streams reset by a failed step (their utterance so far lost)
        self._busy_s = 0.0
        self._incoming: list[_Request] = []
        self._held: set[_Request] = set()  # taken by the thread, not yet answered
        self._active: list[_Request] = []  # thread only: requests with pieces left, oldest first
        self._in_flight: set[int] = set()  # id() of each stream with a request waiting or running
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def busy_s(self) -> float:
        """CPU seconds the thread spent in front ends and model steps since start."""
        return self._busy_s

    @property
    def pending(self) -> int:
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

    def submit(self, stream: ParaformerStream, audio: np.ndarray, is_final: bool) -> concurrent.futures.Future:
        """The tokens `audio` (float32, 16 kHz) completes on `stream`; any thread."""
        request = _Request(stream, np.asarray(audio, np.float32).reshape(-1), is_final)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the ASR batcher has stopped")
            if id(stream) in self._in_flight:
                raise RuntimeError("a stream's audio is decoded in order: one request per stream at a time")
            if len(self._in_flight) >= self.max_pending:
                raise AsrOverloaded(f"{len(self._in_flight)} recognition requests waiting (bound {self.max_pending})")
            self._in_flight.add(id(stream))
            self._incoming.append(request)
            self._cond.notify()
        return request.future

    async def feed(self, stream: ParaformerStream, audio: np.ndarray, is_final: bool) -> Decoded:
        return await asyncio.wrap_future(self.submit(stream, audio, is_final))

    def stats(self) -> dict:
        return {"pending": self.pending, "max_batch": self.max_batch, "batch_sizes": dict(sorted(self.batch_sizes.items())),
                "thread_faults": self.thread_faults, "failed_utterances": self.failed_utterances}

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
                self._fail(request, RuntimeError("the ASR batcher has stopped"))

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
                self._active = [r for r in self._active if r.pieces]
        except BaseException as exc:  # every session's recognition waits on this thread
            self.thread_faults += 1
            log.error("ASR batcher: its loop was broken (%s: %s); failing the %d requests it held and going on",
                      type(exc).__name__, exc, len(self._held), exc_info=exc)
            with self._cond:
                held = list(self._held)
            for request in held:
                request.stream.reset()
                self._fail(request, AsrBatcherFault(f"the ASR batcher was interrupted ({type(exc).__name__}: {exc})"))
            self._active = []
            return False

    def _running(self, incoming: list[_Request]) -> list[_Request]:
        """The requests still wanted, marked running, their pieces cut and their features made. A
        session that went away cancelled its future: its audio is not decoded."""
        running = []
        for request in incoming:
            if not request.future.set_running_or_notify_cancel():
                self._finish(request, cancelled=True)
                continue
            start = time.thread_time()
            try:
                request.pieces = request.stream.pieces(request.audio, request.is_final)
            except Exception as exc:  # bad audio: this request fails, the others go on
                request.stream.reset()
                self._finish(request, exc)
                continue
            finally:
                self._busy_s += time.thread_time() - start
            if request.pieces:
                running.append(request)
            else:  # under one stride and not final: kept for the next call, nothing to decode
                self._finish(request)
        return running

    def _step(self, rows: list[_Request]) -> None:
        start = time.thread_time()
        try:
            results = self.engine.step([(r.stream, r.pieces[0]) for r in rows])
        except BaseException as exc:  # a failing call must not leave its streams waiting forever
            log.exception("ASR batch of %d failed", len(rows))
            if not isinstance(exc, Exception):  # must never reach the event loop
                self.thread_faults += 1
                exc = JobAborted(f"{type(exc).__name__}: {exc}")
            for request in rows:
                request.pieces = []
                request.stream.reset()
                self.failed_utterances += 1
                self._finish(request, RuntimeError(f"recognition step failed; the utterance so far is lost: {exc}"))
            return
        finally:
            self._busy_s += time.thread_time() - start
        self.batch_sizes[len(rows)] += 1
        for request, result in zip(rows, results):
            request.pieces.pop(0)
            request.result.extend(result)
            if not request.pieces:
                self._finish(request)

    def _fail(self, request: _Request, error: Exception) -> None:
        future = request.future
        if future.done():
            return self._finish(request, cancelled=True)
        if not future.running() and not future.set_running_or_notify_cancel():
            return self._finish(request, cancelled=True)
        self._finish(request, error)

    def _finish(self, request: _Request, error: Exception | None = None, cancelled: bool = False) -> None:
        with self._cond:
            self._in_flight.discard(id(request.stream))
            self._held.discard(request)
        if cancelled:
            return
        if error is None:
            request.future.set_result(request.result)
        else:
            request.future.set_exception(error)
