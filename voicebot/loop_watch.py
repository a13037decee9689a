"""How late the event loop runs, and what held it when it ran late.

One process, one loop: anything that holds it delays every session's audio. A heartbeat task on the
loop measures each tick's lateness (voicebot_event_loop_lag_seconds). When a tick comes more than
`threshold_s` late, it is a stall: counted by cause in voicebot_event_loop_stalls_total and logged
with what held the loop (at most one line every LOG_EVERY_S, and every stall longer than all
before it). Three causes, told apart by two
witnesses that are not the loop:

- gc: Python's cyclic collector ran for at least half the stall (`gc.callbacks` time every
  collection, voicebot_gc_pause_seconds), in whichever thread triggered it.
- callback: the loop's own thread ran one callback that long. A watchdog thread, asleep between
  polls, samples that thread's stack once the heartbeat is overdue, and the log line names it.
- gil: the rest. The watchdog found the loop's thread idle (waiting to take the GIL back after its
  selector), or was held itself for at least half the stall: the whole interpreter was held, by a C
  extension that keeps the GIL through a long call (on a worker thread too: running it "off the
  loop" does not help) or by a starved CPU. The log names the busy threads' innermost frames as the
  watchdog found them when it woke late: the holder's are just past its call.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import threading
import time

from voicebot.metrics import Metrics

log = logging.getLogger("voicebot")

BEAT_S = 0.05  # the heartbeat's sleep; the watchdog polls at the same rate
STALL_THRESHOLD_S = 0.1  # a tick later than this is a stall: counted and logged
LOG_EVERY_S = 10.0  # at most one stall line this often (a loaded box stalls often); all are counted
FRAMES_SHOWN = 4  # innermost frames of a stack in a log line
# A thread whose innermost frame is in one of these files waits for work (or in the loop's selector).
_WAITING = {"threading.py", "queue.py", "selectors.py", "runners.py", "thread.py", "base_events.py"}


class GcClock:
    """The time Python's cyclic collector has spent, in total and per collection by generation."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.total_s = 0.0
        self._started: float | None = None

    def install(self) -> None:
        gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # Collections do not nest and hold the GIL from start to stop: no lock needed.
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            pause = time.perf_counter() - self._started
            self._started = None
            self.total_s += pause
            self.metrics.gc_pause.labels(str(info["generation"])).observe(pause)


class LoopWatch:
    """The heartbeat on the loop (`run`, a task) and its watchdog thread (started by `run`)."""

    def __init__(self, metrics: Metrics, threshold_s: float = STALL_THRESHOLD_S, beat_s: float = BEAT_S) -> None:
        self.metrics, self.threshold_s, self.beat_s = metrics, threshold_s, beat_s
        self.gc_clock = GcClock(metrics)
        self._beat_started = time.monotonic()  # when the heartbeat last went to sleep
        self._loop_thread: int | None = None
        # The watchdog's findings for the tick in progress, reset by the heartbeat at each tick.
        self._watchdog_late_s = 0.0  # how late the watchdog itself woke, at most, during the tick
        self._loop_stack: list[str] | None = None  # the loop thread's stack sampled while overdue ([]: it was idle)
        self._threads_on_wake = ""  # the busy threads' stacks when the watchdog last woke late
        self._stop = threading.Event()
        self._last_log = -LOG_EVERY_S
        self._worst_s = 0.0  # the longest stall logged

    async def run(self) -> None:
        """The heartbeat, until cancelled; it starts the watchdog and the GC clock and stops them."""
        self._loop_thread = threading.get_ident()
        self._stop.clear()
        threading.Thread(target=self._watch, name="loop-watchdog", daemon=True).start()
        self.gc_clock.install()
        try:
            while True:
                gc_before = self.gc_clock.total_s
                self._watchdog_late_s, self._loop_stack, self._threads_on_wake = 0.0, None, ""
                self._beat_started = start = time.monotonic()
                await asyncio.sleep(self.beat_s)
                lag = max(0.0, time.monotonic() - start - self.beat_s)
                self.metrics.loop_lag.observe(lag)
                self.metrics.asyncio_tasks.set(len(asyncio.all_tasks()))
                if lag > self.threshold_s:
                    self._stalled(lag, self.gc_clock.total_s - gc_before)
        finally:
            self._stop.set()  # the watchdog ends within one poll
            self.gc_clock.uninstall()

    def _stalled(self, lag: float, gc_s: float) -> None:
        if gc_s >= lag / 2:
            cause, detail = "gc", f"{1000 * gc_s:.0f} ms of it in Python's cyclic GC"
        elif self._loop_stack and self._watchdog_late_s < lag / 2:
            cause, detail = "callback", "in a callback on the loop: " + " < ".join(self._loop_stack)
        else:
            cause = "gil"
            # The watchdog and the loop wait for the same GIL: when the loop gets it first, the
            # thread that kept it has only just let go, so its stack is read from here instead.
            seen = (f"busy threads as the watchdog last woke late: {self._threads_on_wake}" if self._threads_on_wake
                    else f"busy threads as the loop got the GIL back: {self._busy_threads()}")
            detail = (f"the loop's thread was waiting for the GIL (the watchdog woke up to {1000 * self._watchdog_late_s:.0f} ms late): "
                      f"a C call that keeps it, or no CPU; {seen}")
        self.metrics.loop_stalls.labels(cause).inc()
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S or lag > self._worst_s:  # the worst so far always logged
            self._last_log, self._worst_s = now, max(self._worst_s, lag)
            log.warning("event loop held %.0f ms (stall over %.0f ms, cause %s): %s", 1000 * lag,
                        1000 * self.threshold_s, cause, detail)

    def _watch(self) -> None:
        expected = time.monotonic() + self.beat_s
        while not self._stop.wait(self.beat_s):
            now = time.monotonic()
            if now - expected > self.threshold_s / 2:
                # Woken late: whoever held the GIL has just let go, its stack still at the call.
                self._threads_on_wake = self._busy_threads()
            self._watchdog_late_s = max(self._watchdog_late_s, now - expected)
            expected = now + self.beat_s
            overdue = now - self._beat_started - self.beat_s
            if overdue > self.threshold_s / 2 and self._loop_stack is None:
                frame = sys._current_frames().get(self._loop_thread)
                # Found in the selector or the loop's own frames, it ran no callback: it waited for the GIL.
                self._loop_stack = [] if frame is None or _waiting(frame) else _innermost(frame)

    def _busy_threads(self) -> str:
        """The innermost frames of each thread but this one, leaving out those waiting for work."""
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        busy = [f"{names.get(ident, ident)}: {' < '.join(_innermost(frame))}" for ident, frame in sys._current_frames().items()
                if ident != me and not _waiting(frame)]
        return "; ".join(busy) or "(none)"


def _waiting(frame) -> bool:
    return os.path.basename(frame.f_code.co_filename) in _WAITING


def _innermost(frame) -> list[str]:
    """`dir/file:line function` of a stack's FRAMES_SHOWN innermost frames, innermost first (no
    source read: the watchdog holds the GIL while it looks)."""
    shown = []
    while frame is not None and len(shown) < FRAMES_SHOWN:
        code = frame.f_code
        if not code.co_filename.startswith("<frozen importlib"):  # an import's machinery: show who imports
            shown.append(f"{'/'.join(code.co_filename.split('/')[-2:])}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return shown
