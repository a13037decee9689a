"""The engine worker pool: a call's fault stays with that call, and no call waits for a thread that is gone."""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time

import pytest

from voicebot.serving.worker import JobAborted, Worker


def kill(thread: threading.Thread) -> None:
    """SystemExit in `thread` at its next Python instruction (idle: as it takes its next call)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit))


def threads_of(worker: Worker) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"worker-{worker.name}_")]


def test_a_call_that_raises_fails_only_itself():
    worker = Worker("raises")

    def exits():
        raise SystemExit("a library called exit()")

    async def run():
        with pytest.raises(ValueError):
            await worker.run(int, "not a number")
        with pytest.raises(JobAborted, match="SystemExit"):  # never a BaseException on the event loop
            await worker.run(exits)
        return await worker.run(lambda: 42)

    try:
        assert asyncio.run(run()) == 42
        assert worker.pending == 0 and worker.threads_lost == 0
    finally:
        worker.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the threads killed on purpose
@pytest.mark.parametrize("threads", [1, 2])
def test_a_dead_thread_is_replaced_and_the_call_it_took_still_runs(threads):
    worker = Worker(f"dies{threads}", threads=threads)

    async def run():
        await asyncio.gather(*(worker.run(time.sleep, 0.05) for _ in range(threads)))  # every thread started
        doomed = threads_of(worker)
        for thread in doomed:
            kill(thread)
        results = await asyncio.wait_for(asyncio.gather(*(worker.run(lambda i=i: i) for i in range(5))), 5)
        deadline = time.monotonic() + 5
        while any(t.is_alive() for t in doomed) and time.monotonic() < deadline:
            await worker.run(lambda: None)  # a thread still waiting meets its exception when woken
            await asyncio.sleep(0.01)
        return doomed, results

    try:
        doomed, results = asyncio.run(run())
        assert results == [0, 1, 2, 3, 4]
        assert len(doomed) == threads and not any(t.is_alive() for t in doomed)
        assert worker.threads_lost == threads and len(threads_of(worker)) == threads
        assert worker.pending == 0
    finally:
        worker.shutdown()


def test_shutdown_cancels_what_is_queued_and_ends_the_threads():
    worker = Worker("shut")
    running = worker.submit(time.sleep, 0.2)
    queued = worker.submit(lambda: "never")
    time.sleep(0.05)
    worker.shutdown()
    assert running.result(5) is None
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda: None)
    deadline = time.monotonic() + 5
    while threads_of(worker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not threads_of(worker) and worker.threads_lost == 0
