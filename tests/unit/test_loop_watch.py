"""The loop watch tells a stall's three causes apart and names what held the loop."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import threading
import time

import pytest

from voicebot import loop_watch
from voicebot.loop_watch import LoopWatch
from voicebot.metrics import Metrics

HOLD_S = 0.4  # four times the stall threshold: a stall on any box


def _stalls(metrics: Metrics) -> dict[str, float]:
    return {cause: metrics.loop_stalls.labels(cause)._value.get() for cause in ("gc", "gil", "callback")}


async def _watched(hold, caplog) -> tuple[Metrics, list[str]]:
    """Await `hold()` under a LoopWatch; its metrics and the stall lines it logged."""
    metrics = Metrics()
    watcher = LoopWatch(metrics)
    watch = asyncio.create_task(watcher.run())
    await asyncio.sleep(0.2)  # the watchdog running and a few ticks on time
    with caplog.at_level(logging.WARNING, logger="voicebot"):
        await hold()
        await asyncio.sleep(0.2)  # the tick after the stall
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
    assert watcher.gc_clock._on_gc not in gc.callbacks  # the watch took its callback back out
    return metrics, [r.getMessage() for r in caplog.records if "event loop held" in r.getMessage()]


@pytest.fixture(autouse=True)
def every_stall_logged(monkeypatch):
    monkeypatch.setattr(loop_watch, "LOG_EVERY_S", 0.0)


def _slow_callback_on_the_loop() -> None:
    time.sleep(HOLD_S)  # releases the GIL: only the loop's thread is held


def test_a_slow_callback_is_named_by_its_stack(caplog):
    async def hold():
        _slow_callback_on_the_loop()

    metrics, lines = asyncio.run(_watched(hold, caplog))
    assert _stalls(metrics)["callback"] == 1 and _stalls(metrics)["gil"] == 0
    assert len(lines) == 1 and "cause callback" in lines[0] and "_slow_callback_on_the_loop" in lines[0]
    assert metrics.loop_lag._sum.get() >= HOLD_S / 2


# A C call that keeps the GIL for as long as it is told, like a C extension's long call: libc's
# usleep through ctypes.PyDLL, which (unlike CDLL) does not release the GIL around the call. Timed,
# not a fixed amount of work, so it holds as long on any machine.
_LIBC_KEEPING_THE_GIL = ctypes.PyDLL(ctypes.util.find_library("c"))


def _keeps_the_gil() -> None:
    time.sleep(0.1)  # the loop back in its selector first: what it waits for then is the GIL
    _LIBC_KEEPING_THE_GIL.usleep(int(HOLD_S * 1e6))
    time.sleep(0.1)  # the GIL let go with this frame still here, for the watchdog to see as it wakes


def test_a_thread_that_keeps_the_gil_is_a_gil_stall_with_its_thread_named(caplog):
    async def hold():
        thread = threading.Thread(target=_keeps_the_gil, name="gil-keeper")
        thread.start()
        await asyncio.to_thread(thread.join)

    metrics, lines = asyncio.run(_watched(hold, caplog))
    stalls = _stalls(metrics)
    assert stalls["gil"] >= 1 and stalls["callback"] == 0
    assert "cause gil" in lines[0] and "gil-keeper" in lines[0] and "_keeps_the_gil" in lines[0]


def test_a_long_collection_is_a_gc_stall_and_its_pause_is_measured(caplog):
    garbage = []
    for _ in range(300_000):
        cell: list = []
        cell.append(cell)  # a cycle: only the cyclic GC frees it
        garbage.append(cell)

    async def hold():
        nonlocal garbage
        garbage = None
        started = time.perf_counter()
        while time.perf_counter() - started < HOLD_S:
            gc.collect()

    metrics, lines = asyncio.run(_watched(hold, caplog))
    assert _stalls(metrics)["gc"] == 1
    assert "cause gc" in lines[0] and "cyclic GC" in lines[0]
    assert metrics.gc_pause.labels("2")._sum.get() >= HOLD_S / 2


def test_between_lines_only_a_stall_longer_than_all_before_it_is_logged(caplog, monkeypatch):
    monkeypatch.setattr(loop_watch, "LOG_EVERY_S", 600.0)

    async def hold():
        for held_s in (0.15, 0.6, 0.15):  # the last: shorter than the worst, within the interval
            time.sleep(held_s)
            await asyncio.sleep(0.2)

    metrics, lines = asyncio.run(_watched(hold, caplog))
    assert _stalls(metrics)["callback"] == 3
    assert len(lines) == 2


def test_a_running_server_freezes_its_heap_and_counts_a_stall_on_its_loop():
    from tests.conftest import make_settings, running_server

    with running_server(make_settings()) as server:
        assert gc.get_freeze_count() > 0  # start-up's objects out of every collection
        before = server.metric("voicebot_event_loop_stalls_total", 'cause="callback"')
        server.on_loop(_slow_callback_on_the_loop)
        deadline = time.monotonic() + 10
        while server.metric("voicebot_event_loop_stalls_total", 'cause="callback"') == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.metric("voicebot_event_loop_stalls_total", 'cause="callback"') >= before + 1
        assert server.metric("voicebot_event_loop_lag_seconds_count") > 0
        assert 'voicebot_gc_pause_seconds_count{generation="2"}' in server.get("/metrics").text
    assert gc.get_freeze_count() == 0  # thawed at shutdown: a later app can free this one's engines
