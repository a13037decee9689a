"""Admission control of the CPU engines (voicebot/serving/capacity.py), on a fake clock: the pools'
load and learnt costs, the cold start, and the input lag."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from voicebot.serving.capacity import LATE_SHARE, MARGINAL_FLOOR, SAMPLE_S, WINDOW_S, Admission, GilThreads, InputLag, ServerCpu
from voicebot.serving.lateness import LATE_MEMORY_S
from voicebot.serving.worker import Worker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class BusyWorker(Worker):
    """A pool whose busy time the test sets (as running calls would add to it)."""

    def __init__(self, threads: int, name: str = "asr") -> None:
        super().__init__(name, threads)
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


def test_the_gil_pool_is_the_cpu_time_of_the_thread_that_built_it_and_of_those_given():
    go, done = threading.Event(), threading.Event()

    def clock_thread():  # as the input clock: computes when told, lives on
        go.wait()
        spin(0.05)
        done.set()
        go.clear()
        go.wait()

    other = threading.Thread(target=clock_thread, daemon=True)
    other.start()
    gil = GilThreads([other.ident])
    before = gil.busy_s
    spin(0.05)
    time.sleep(0.1)
    assert 0.05 <= gil.busy_s - before < 0.1  # its own thread's
    go.set()
    done.wait()
    assert 0.1 <= gil.busy_s - before < 0.2  # and the other's
    go.set()


def test_an_idle_pool_admits_and_a_saturated_one_refuses():
    clock, worker = Clock(), BusyWorker(threads=2)
    adm = Admission([worker], max_load=0.85, clock=clock)
    run_for(adm, worker, clock, WINDOW_S, load=0.1, sessions=1)
    assert adm.refuse(1) is None
    run_for(adm, worker, clock, WINDOW_S, load=0.95, sessions=6)
    refusal = adm.refuse(6)
    assert (refusal.reason, refusal.pool) == ("pool_load", "asr") and refusal.retry_after_s > 0
    run_for(adm, worker, clock, WINDOW_S, load=0.0, sessions=0)  # everyone left
    assert adm.pools[0].load() == 0.0


def test_the_learnt_cost_refuses_a_burst_before_it_speaks():
    clock, worker = Clock(), BusyWorker(threads=2)
    adm = Admission([worker], max_load=0.85, clock=clock)
    # Four sessions kept the pool 60 % busy for a minute: 0.15 each.
    run_for(adm, worker, clock, 60, load=0.6, sessions=4)
    assert abs(adm.pools[0].cost() - 0.15) < 0.01
    # They all pause at once: the pool is idle now (the pause lowers the learnt cost a little),
    # yet a fifth fits and an eighth does not.
    run_for(adm, worker, clock, WINDOW_S, load=0.0, sessions=4)
    assert adm.pools[0].load() == 0.0 and 0.12 < adm.pools[0].cost() <= 0.15
    assert adm.refuse(4) is None  # 5 x <= 0.15 = 0.75
    assert adm.refuse(7).reason == "pool_load"  # 8 x > 0.12 = 0.96 > 0.85


def test_a_pool_too_idle_to_measure_learns_no_cost_only_a_bound():
    clock, worker = Clock(), BusyWorker(threads=1)
    adm = Admission([worker], max_load=0.85, cold_start_sessions=4, clock=clock)
    run_for(adm, worker, clock, 30, load=0.01, sessions=3)
    assert adm.pools[0].line() is None
    assert adm.pools[0].cost_bound == pytest.approx(0.05 / 3)  # under 5 % with 3 connected
    assert adm.refuse(100) is None  # nothing says 101 sessions would fill it
    for _ in range(10):  # and a burst goes by the bound, not by the cold start's 4 per window
        adm.admitted()
    assert adm.refuse(13) is None


def test_a_burst_at_cold_start_gets_cold_start_sessions_in_per_window():
    clock, worker = Clock(), BusyWorker(threads=2)
    adm = Admission([worker], max_load=0.8, cold_start_sessions=4, clock=clock)
    let_in = 0
    for _ in range(16):  # sixteen connect at once, before any cost is known
        if adm.refuse(let_in) is None:
            adm.admitted()
            let_in += 1
    assert let_in == 4
    refusal = adm.refuse(let_in)
    assert refusal.reason == "cold_start" and refusal.retry_after_s == WINDOW_S
    # Their first window says nothing yet (their start-ups); once a whole window holds their load,
    # the next are let in by what it says.
    run_for(adm, worker, clock, WINDOW_S, load=0.2, sessions=4)
    assert adm.pools[0].cost() is None and adm.refuse(4).reason == "cold_start"
    run_for(adm, worker, clock, WINDOW_S, load=0.2, sessions=4)
    assert adm.pools[0].cost() == pytest.approx(0.05)  # 0.2 over 4
    assert adm.refuse(4) is None


def lag_admission(clock: Clock, worker: BusyWorker) -> tuple[Admission, InputLag]:
    lag = InputLag(deadline_s=0.25, clock=clock)
    return Admission([worker], max_load=0.85, lag=lag, clock=clock), lag


def test_late_input_in_several_sessions_refuses_the_next_one_whatever_holds_the_cpu():
    clock, worker = Clock(), BusyWorker(threads=1)
    adm, lag = lag_admission(clock, worker)
    run_for(adm, worker, clock, WINDOW_S, load=0.1, sessions=20)  # our pools idle: another tenant holds the box
    lag.observe("pocketsphinx-0", "s1", [0.01] * 90)
    lag.observe("pocketsphinx-1", "s2", [0.01] * 80 + [0.4] * 10)
    lag.observe("pocketsphinx-1", "s3", [0.4] * 10)  # 10 % of all late, in two sessions, on one pool
    refusal = adm.refuse(20)
    assert (refusal.reason, refusal.pool) == ("input_lag", "pocketsphinx-1") and refusal.retry_after_s > 0
    # The window turns over with everyone on time again: room.
    clock.now += WINDOW_S + 0.1
    lag.observe("pocketsphinx-1", "s2", [0.02] * 100)
    assert adm.refuse(20) is None


def test_a_few_late_chunks_or_one_late_session_refuse_nobody():
    clock, worker = Clock(), BusyWorker(threads=1)
    adm, lag = lag_admission(clock, worker)
    run_for(adm, worker, clock, WINDOW_S, load=0.1, sessions=20)
    late = int(100 * LATE_SHARE)
    lag.observe("p", "s1", [0.01] * (100 - late))
    lag.observe("p", "s2", [1.0] * late)  # 5 %: not more than the share
    assert adm.refuse(20) is None
    clock.now += WINDOW_S + 0.1
    lag.observe("p", "s1", [0.01] * 50)
    lag.observe("p", "s2", [2.0] * 50)  # one session's decoding process restarting, say
    assert lag.late_share() == (0.5, "p", 1) and adm.refuse(20) is None


def test_the_lag_report_and_metrics():
    clock, registry = Clock(), CollectorRegistry()
    histogram = Histogram("lag", "", ["pool"], buckets=(0.1, 1.0), registry=registry)
    misses = Counter("misses", "", ["pool"], registry=registry)
    lag = InputLag(0.25, histogram, misses, clock=clock)
    lag.observe("a", "s", [0.01 * i for i in range(1, 101)])  # 10 ms .. 1 s
    report = lag.report()["a"]
    assert report["chunks"] == 100 and report["p50_s"] == pytest.approx(0.505) and report["p95_s"] == pytest.approx(0.9505)
    assert report["deadline_misses"] == 75
    assert registry.get_sample_value("lag_count", {"pool": "a"}) == 100
    assert registry.get_sample_value("lag_bucket", {"pool": "a", "le": "0.1"}) == 10
    assert registry.get_sample_value("misses_total", {"pool": "a"}) == 75
    clock.now += WINDOW_S + 1  # the window is empty; the misses since start stay
    assert lag.report()["a"] == {"chunks": 0, "deadline_misses": 75, "p50_s": None, "p95_s": None}


def test_the_server_pool_is_the_process_and_its_children_over_the_cores():
    children = [0.0]
    server = ServerCpu(lambda: children[0])
    before = server.busy_s
    spin(0.05)
    children[0] = 1.0  # a decoding child answered for a second of CPU
    assert 1.05 <= server.busy_s - before < 1.2 and server.threads >= 1


def test_what_a_pool_does_with_nobody_connected_is_no_session_s_cost():
    clock, worker = Clock(), BusyWorker(threads=2)
    adm = Admission([worker], max_load=0.85, clock=clock)
    run_for(adm, worker, clock, WINDOW_S, load=0.9, sessions=0)  # the server's start-up: not its idle load
    assert adm.pools[0].idle_load == 0.0  # over IDLE_LOAD_MAX: something that ends, not its idle load
    run_for(adm, worker, clock, 2 * WINDOW_S, load=0.08, sessions=0)  # its own timers and samplers
    assert adm.pools[0].idle_load == pytest.approx(0.08)
    # Four sessions keep it 48 % busy for a minute: 0.1 each over the idle 0.08 (0.12 as an average).
    run_for(adm, worker, clock, 60, load=0.48, sessions=4)
    assert adm.pools[0].cost() == pytest.approx(0.1, abs=0.005)
    assert adm.refuse(6) is None  # 0.08 + 7 x 0.1 = 0.78
    assert adm.refuse(7).reason == "pool_load"  # 0.08 + 8 x 0.1 = 0.88 > 0.85 (8 x 0.1 = 0.8 would fit)
    assert adm.report()["asr"]["idle_load"] == pytest.approx(0.08)


def shared_plus_each(sessions: int) -> float:
    """A pool whose sessions share 0.10 of its load (batches, ticks) and add 0.08 each."""
    return 0.10 + 0.08 * sessions


def test_admission_goes_by_the_marginal_cost_not_the_average():
    clock, worker = Clock(), BusyWorker(threads=1)
    adm = Admission([worker], max_load=0.85, clock=clock)
    sessions = 1
    run_for(adm, worker, clock, 2 * WINDOW_S, load=shared_plus_each(1), sessions=1)
    assert adm.pools[0].cost() == pytest.approx(0.18)  # one level: the average, all it can say
    while adm.refuse(sessions) is None:  # one at a time, each measured before the next
        adm.admitted()
        sessions += 1
        run_for(adm, worker, clock, 2 * WINDOW_S, load=shared_plus_each(sessions), sessions=sessions)
    # 0.10 + 9 x 0.08 = 0.82 fits, a tenth would be 0.90; by the lone speaker's average (0.18) it
    # would have stopped at 4.
    assert sessions == 9 and adm.refuse(sessions).reason == "pool_load"
    assert adm.pools[0].line() == pytest.approx((0.10, 0.08), abs=0.002)
    assert adm.report()["asr"]["marginal_cost"] == pytest.approx(0.08, abs=0.002)


def test_a_burst_once_the_line_is_known_is_let_in_to_the_limit_and_no_further():
    clock, worker = Clock(), BusyWorker(threads=1)
    adm = Admission([worker], max_load=0.85, cold_start_sessions=100, clock=clock)
    for sessions in (1, 2):
        run_for(adm, worker, clock, 2 * WINDOW_S, load=shared_plus_each(sessions), sessions=sessions)
    sessions = 2
    while adm.refuse(sessions) is None:  # all at once: none of them speaks within the window
        adm.admitted()
        sessions += 1
    assert sessions == 9  # 0.26 now + 7 x 0.08 = 0.82: the newcomers at the marginal cost
    assert adm.refuse(sessions).reason == "pool_load"


def test_an_admitted_speaker_falling_behind_refuses_the_next_one_whatever_the_line_says():
    clock, worker = Clock(), BusyWorker(threads=1)
    lag = InputLag(deadline_s=0.25, clock=clock)
    adm = Admission([worker], max_load=0.85, lag=lag, clock=clock)
    for sessions in (1, 2, 3):
        run_for(adm, worker, clock, 2 * WINDOW_S, load=shared_plus_each(sessions), sessions=sessions)
    assert adm.refuse(3) is None  # the line says 0.42 with a fourth
    lag.observe("pocketsphinx-0", "s1", [0.4] * 20)
    lag.observe("pocketsphinx-0", "s2", [0.4] * 20)
    assert adm.refuse(3).reason == "input_lag"


def test_a_flat_line_from_noisy_levels_is_not_taken_for_free_sessions():
    clock, worker = Clock(), BusyWorker(threads=1)
    adm = Admission([worker], max_load=0.85, clock=clock)
    for sessions in (4, 5):  # one more session, the same load: the pauses fell that way
        run_for(adm, worker, clock, 2 * WINDOW_S, load=0.5, sessions=sessions)
    fixed, marginal = adm.pools[0].line()
    least_average = min(v.load / v.sessions for v in adm.pools[0].levels.values())  # about 0.5 / 5
    assert marginal == pytest.approx(MARGINAL_FLOOR * least_average)  # a share of it, not 0
    assert adm.refuse(5) is None  # about 0.28 + 6 x 0.05
    assert adm.refuse(20).reason == "pool_load"  # about 0.28 + 21 x 0.05 = 1.33: the floor still bounds it


def late_window(adm: Admission, worker: BusyWorker, lag: InputLag, clock: Clock, sessions: int, late: bool) -> None:
    """A whole window with `sessions` connected; when `late`, two of them have 10 % of their chunks late."""
    for _ in range(int(WINDOW_S / SAMPLE_S) + 1):
        clock.now += SAMPLE_S
        worker.busy += 0.1 * SAMPLE_S
        lag.observe("pocketsphinx-0", "s1", [0.01] * 9 + [0.5 if late else 0.01])
        lag.observe("pocketsphinx-0", "s2", [0.01] * 9 + [0.5 if late else 0.01])
        adm.sample(sessions)


def test_a_number_of_sessions_the_input_was_late_at_is_not_let_in_again_while_it_is_remembered():
    """A burst of connects is kept from the number of sessions the input was late at (the pools' lines
    do not see the GIL): until a window with as many on time, or LATE_MEMORY_S."""
    clock, worker = Clock(), BusyWorker(threads=1)
    adm, lag = lag_admission(clock, worker)
    late_window(adm, worker, lag, clock, sessions=12, late=False)
    late_window(adm, worker, lag, clock, sessions=12, late=True)
    assert adm.late_levels.limit() == (12, "pocketsphinx-0") and adm.late_levels.report() == {"12": 0.0}
    # Everyone leaves and the lag window turns over: nothing is late now, the level is remembered.
    run_for(adm, worker, clock, WINDOW_S + SAMPLE_S, load=0.0, sessions=0)
    assert lag.late_share()[0] == 0.0
    assert adm.refuse(10) is None  # 11 connected: fewer than were late
    refusal = adm.refuse(11)
    assert (refusal.reason, refusal.pool) == ("input_lag", "pocketsphinx-0") and refusal.retry_after_s > 0
    assert "12 sessions" in refusal.message
    # A whole window with 12 on time: there is room at 12 again.
    late_window(adm, worker, lag, clock, sessions=12, late=False)
    assert adm.late_levels.limit() is None and adm.refuse(11) is None
    # Late again at 12, then not seen again for LATE_MEMORY_S: one more may try it.
    late_window(adm, worker, lag, clock, sessions=12, late=True)
    run_for(adm, worker, clock, WINDOW_S + SAMPLE_S, load=0.0, sessions=0)
    assert adm.refuse(11) is not None
    clock.now += LATE_MEMORY_S
    assert adm.refuse(11) is None


def test_lateness_at_fewer_sessions_than_before_lowers_the_limit_and_one_late_session_does_not():
    clock, worker = Clock(), BusyWorker(threads=1)
    adm, lag = lag_admission(clock, worker)
    late_window(adm, worker, lag, clock, sessions=12, late=True)
    for _ in range(4):  # 8 leave; the window still holds the lateness of when they were there
        clock.now += SAMPLE_S
        adm.sample(4)
    assert adm.late_levels.limit()[0] == 12  # not 4 or a mean on the way down
    late_window(adm, worker, lag, clock, sessions=8, late=True)  # another tenant took the box meanwhile
    assert adm.late_levels.limit()[0] == 8
    late_window(adm, worker, lag, clock, sessions=10, late=False)  # on time with 10: 8 is no limit now
    assert 10 < adm.late_levels.limit()[0] <= 12  # 12, or a window's mean on the way down from it
    for _ in range(int(WINDOW_S / SAMPLE_S) + 1):  # one session late alone: its own matter
        clock.now += SAMPLE_S
        lag.observe("pocketsphinx-1", "s9", [2.0] * 10)
        adm.sample(6)
    assert 6 not in adm.late_levels.late


def run_lagging(adm: Admission, worker: BusyWorker, lag: InputLag, clock: Clock, seconds: float, sessions: int, load: float,
                lags_s: list[float]) -> None:
    """`seconds` with `sessions` connected, the pool `load` busy, and each session's 20 ms chunks
    processed this late (session i's at lags_s[i], the last of the list for the rest)."""
    for _ in range(int(seconds / SAMPLE_S)):
        clock.now += SAMPLE_S
        worker.busy += load * worker.threads * SAMPLE_S
        for i in range(sessions):
            lag.observe("pocketsphinx-0", f"s{i}", [lags_s[min(i, len(lags_s) - 1)]] * int(SAMPLE_S / 0.02))
        adm.sample(sessions)


def burst(adm: Admission, sessions: int) -> int:
    """Connects all at once (none speaks within the window): the number connected once one is refused."""
    while adm.refuse(sessions) is None:
        adm.admitted()
        sessions += 1
    return sessions


def ten_plus_five(sessions: int) -> float:
    """A pool whose sessions share 0.10 of its load and add 0.05 each."""
    return 0.10 + 0.05 * sessions


def forecast_admission(clock: Clock, worker: BusyWorker) -> tuple[Admission, InputLag]:
    lag = InputLag(deadline_s=0.25, clock=clock)
    return Admission([worker], max_load=0.85, lag=lag, cold_start_sessions=100, clock=clock), lag


def test_a_burst_inside_one_window_is_refused_at_the_count_the_lag_forecast_puts_past_the_deadline():
    """The lag p95 measured at 2 and 4 sessions (0.08 and 0.10 s: on time) with the pool's line at
    0.10 + 0.05 n: as a queue's, 0.07 s at no load (0.10 x (1 - 0.30)), so 0.07 / (1 - load) passes
    0.25 s past a load of 0.72, at 13 sessions (0.75). No window is late, and the pools' rules stop
    the burst at 14 (0.30 now + 11 x 0.05 = 0.85): before the forecast, 14 were let in."""
    clock, worker = Clock(), BusyWorker(threads=1)
    adm, lag = forecast_admission(clock, worker)
    run_lagging(adm, worker, lag, clock, 3 * WINDOW_S, sessions=2, load=ten_plus_five(2), lags_s=[0.08])
    run_lagging(adm, worker, lag, clock, 6 * WINDOW_S, sessions=4, load=ten_plus_five(4), lags_s=[0.10])
    assert adm.pools[0].line() == pytest.approx((0.10, 0.05), abs=0.002)
    scale_s, at = adm.lag_levels.scale()
    assert at == 4 and scale_s == pytest.approx(0.10 * (1 - 0.30), abs=0.002)
    assert lag.late_share()[0] == 0.0 and adm.late_levels.limit() is None
    connected = burst(adm, 4)
    assert connected == 12  # 12 fit (0.07 / (1 - 0.70) = 0.23 s), the 13th would bring 0.28 s
    over = next(n for n in range(5, 100) if adm.pools[0].predict(n) >= 1 or scale_s / (1 - adm.pools[0].predict(n)) > 0.25)
    assert connected == over - 1  # the count the forecast names, from what was learnt
    refusal = adm.refuse(connected)
    assert (refusal.reason, refusal.pool, refusal.retry_after_s) == ("input_lag_forecast", "asr", WINDOW_S)
    assert "13 sessions" in refusal.message and "0.28 s" in refusal.message
    assert adm.pools[0].predict(connected + 1) < 0.85  # the pools' own rule would not have refused it
    report = adm.lag_report(connected)
    assert report["next_session"]["p95_s"] == pytest.approx(0.28, abs=0.01) and set(report["levels"]) == {"2", "4"}


def test_the_lag_rising_within_the_window_lowers_the_forecast_count_at_once():
    """Learnt on time (0.01 s), then, a second ago, two sessions' chunks 0.2 s late: not past the
    deadline, so no rule on lateness refuses; as a queue's at the load now (0.30), 0.14 s at no load:
    one more session than 6 (0.45) would bring 0.255 s."""
    clock, worker = Clock(), BusyWorker(threads=1)
    adm, lag = forecast_admission(clock, worker)
    run_lagging(adm, worker, lag, clock, 3 * WINDOW_S, sessions=2, load=ten_plus_five(2), lags_s=[0.01])
    run_lagging(adm, worker, lag, clock, 6 * WINDOW_S, sessions=4, load=ten_plus_five(4), lags_s=[0.01])
    assert burst(adm, 4) == 14  # on time: the pools' rule stops it (0.30 now + 11 x 0.05 = 0.85)
    adm._admitted.clear()  # those were not let in: the same four connected
    clock.now += 1.0
    lag.observe("pocketsphinx-0", "s0", [0.2] * 50)
    lag.observe("pocketsphinx-0", "s1", [0.2] * 50)
    assert lag.late_share()[0] == 0.0  # nobody late yet
    assert burst(adm, 4) == 6
    assert adm.refuse(6).reason == "input_lag_forecast"


def test_one_session_late_alone_does_not_move_the_forecast():
    clock, worker = Clock(), BusyWorker(threads=1)
    adm, lag = forecast_admission(clock, worker)
    run_lagging(adm, worker, lag, clock, 3 * WINDOW_S, sessions=2, load=ten_plus_five(2), lags_s=[0.01])
    run_lagging(adm, worker, lag, clock, 6 * WINDOW_S, sessions=4, load=ten_plus_five(4), lags_s=[2.0, 0.01])
    assert lag.shared_p95() == pytest.approx(0.01)  # the second worst session's: its decoder restarting, say
    assert adm.lag_levels.scale()[0] < 0.01
    assert burst(adm, 4) == 14


def test_a_lag_level_weighs_for_a_minute_then_the_levels_learnt_since_say():
    """Another tenant's load made the input lag at 8 sessions; the levels learnt since, at 4, are on
    time: the 8's scale holds the forecast down for LATE_MEMORY_S after it was last seen, then the
    most recent level's says."""
    clock, worker = Clock(), BusyWorker(threads=1)
    adm, lag = forecast_admission(clock, worker)
    run_lagging(adm, worker, lag, clock, 3 * WINDOW_S, sessions=8, load=0.5, lags_s=[0.2])
    run_lagging(adm, worker, lag, clock, 3 * WINDOW_S, sessions=4, load=0.3, lags_s=[0.02])
    assert adm.lag_levels.scale() == (pytest.approx(0.2 * 0.5, abs=0.01), 8)
    clock.now += LATE_MEMORY_S
    assert adm.lag_levels.scale() == (pytest.approx(0.02 * 0.7, abs=0.002), 4)  # the most recently learnt


def test_beyond_the_most_sessions_the_lag_was_measured_at_a_burst_goes_at_the_cold_start_s_pace():
    """The pools' costs are known (learnt at 2 and 4 sessions) and the lag was on time there: a
    burst is let in 4 (cold_start_sessions) beyond the 4 measured, then, once a window held at
    least 7 throughout, 4 beyond that; a burst before any lag was measured (a fresh server whose
    pools learnt from one session) gets 4 in."""
    clock, worker = Clock(), BusyWorker(threads=1)
    lag = InputLag(deadline_s=0.25, clock=clock)
    adm = Admission([worker], max_load=0.85, lag=lag, cold_start_sessions=4, clock=clock)
    run_lagging(adm, worker, lag, clock, 3 * WINDOW_S, sessions=2, load=ten_plus_five(2), lags_s=[0.01])
    run_lagging(adm, worker, lag, clock, 3 * WINDOW_S, sessions=4, load=ten_plus_five(4), lags_s=[0.01])
    assert burst(adm, 4) == 8
    refusal = adm.refuse(8)
    assert (refusal.reason, refusal.retry_after_s) == ("cold_start", WINDOW_S) and "beyond the 4" in refusal.message
    run_lagging(adm, worker, lag, clock, WINDOW_S, sessions=8, load=ten_plus_five(8), lags_s=[0.01])
    run_lagging(adm, worker, lag, clock, SAMPLE_S, sessions=7, load=ten_plus_five(7), lags_s=[0.01])
    run_lagging(adm, worker, lag, clock, SAMPLE_S, sessions=5, load=ten_plus_five(5), lags_s=[0.01])
    # At least 7 were connected throughout the last window that held only the 8's and the 7's: 7 measured.
    assert adm.lag_levels.measured == 7
    assert adm.lag_report(5)["measured_sessions"] == 7
    assert burst(adm, 5) == 11

    clock, worker = Clock(), BusyWorker(threads=1)
    lag = InputLag(deadline_s=0.25, clock=clock)
    adm = Admission([worker], max_load=0.85, lag=lag, cold_start_sessions=4, clock=clock)
    run_for(adm, worker, clock, 2 * WINDOW_S, load=0.06, sessions=1)  # one session: no lag level
    assert adm.pools[0].cost() == pytest.approx(0.06) and not adm.lag_levels.levels  # 14 fit by the load
    assert burst(adm, 1) == 5 and adm.refuse(5).reason == "cold_start"
