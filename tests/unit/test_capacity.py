"""Admission control of the thread pools that cannot batch (voicebot/serving/capacity.py), on a fake clock."""

from __future__ import annotations

import time

from voicebot.serving.capacity import SAMPLE_S, WINDOW_S, Admission
from voicebot.serving.worker import Worker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class BusyWorker(Worker):
    """A pool whose busy time the test sets (as running calls would add to it)."""

    def __init__(self, threads: int) -> None:
        super().__init__("asr", threads)
        self.busy = 0.0

    @property
    def busy_s(self) -> float:
        return self.busy


def run_for(adm: Admission, worker: BusyWorker, clock: Clock, seconds: float, load: float, sessions: int) -> None:
    for _ in range(int(seconds / SAMPLE_S)):
        clock.now += SAMPLE_S
        worker.busy += load * worker.threads * SAMPLE_S
        adm.sample(sessions)


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_pool_measures_the_cpu_time_of_its_calls():
    worker = Worker("w", threads=2)
    try:
        for f in [worker.submit(spin, 0.05) for _ in range(4)]:
            f.result()
        assert 0.2 <= worker.busy_s < 0.4  # 4 x 50 ms of computing
        worker.submit(time.sleep, 0.2).result()
        assert worker.busy_s < 0.4  # waiting computes nothing
    finally:
        worker.shutdown()


def test_an_idle_pool_admits_and_a_saturated_one_refuses():
    clock, worker = Clock(), BusyWorker(threads=2)
    adm = Admission([worker], max_load=0.85, clock=clock)
    run_for(adm, worker, clock, WINDOW_S, load=0.1, sessions=1)
    assert adm.refuse(1) is None
    run_for(adm, worker, clock, WINDOW_S, load=0.95, sessions=6)
    pool, retry_after = adm.refuse(6)
    assert pool == "asr" and retry_after > 0
    run_for(adm, worker, clock, WINDOW_S, load=0.0, sessions=0)  # everyone left
    assert adm.pools[0].load() == 0.0


def test_the_learnt_cost_refuses_a_burst_before_it_speaks():
    clock, worker = Clock(), BusyWorker(threads=2)
    adm = Admission([worker], max_load=0.85, clock=clock)
    # Four sessions kept the pool 60 % busy for a minute: 0.15 each.
    run_for(adm, worker, clock, 60, load=0.6, sessions=4)
    assert abs(adm.pools[0].cost_per_session - 0.15) < 0.01
    # They all pause at once: the pool is idle now (the pause lowers the learnt cost a little),
    # yet a fifth fits and an eighth does not.
    run_for(adm, worker, clock, WINDOW_S, load=0.0, sessions=4)
    assert adm.pools[0].load() == 0.0 and 0.12 < adm.pools[0].cost_per_session <= 0.15
    assert adm.refuse(4) is None  # 5 x <= 0.15 = 0.75
    assert adm.refuse(7) is not None  # 8 x > 0.12 = 0.96 > 0.85


def test_a_pool_too_idle_to_measure_learns_nothing():
    clock, worker = Clock(), BusyWorker(threads=1)
    adm = Admission([worker], max_load=0.85, clock=clock)
    run_for(adm, worker, clock, 30, load=0.01, sessions=3)
    assert adm.pools[0].cost_per_session is None
    assert adm.refuse(100) is None
