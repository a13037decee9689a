"""The scheduler thread (voicebot/serving/scheduler.py, with its render_queue.py, scheduler_requests.py and
step_costs.py): ordering, bounds, slots, costs."""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time

import numpy as np
import pytest

from tests.cosyvoice2.conftest import lm  # noqa: F401 (a fixture: the tiny random LM)
from tests.cosyvoice2.test_lm_pool import REQUESTS, alone, ras
from voicebot.tts.cosyvoice2.lm_pool import DECODE_BUCKETS, LMPool, decode_bucket
from voicebot.serving.model_interfaces import Rendering
from voicebot.serving.scheduler import Scheduler
from voicebot.serving.scheduler_requests import Overloaded, Render, SchedulerFault
from voicebot.serving.step_costs import StepCosts
from voicebot.serving.worker import JobAborted
from voicebot.tts.cosyvoice2.lm import unistream


RENDERED: list[list] = []  # the chunks of each render call, in order


def render(chunks: list) -> list[np.ndarray]:
    RENDERED.append(list(chunks))
    return [np.full(10, chunk, dtype=np.float32) for chunk in chunks]


def make_scheduler(lm, **kwargs) -> Scheduler:
    return Scheduler("test", LMPool(lm, slots=2, max_seq_len=256, prefill_chunk=8), render, max_pending=8, **kwargs)


@pytest.fixture
def scheduler(lm):
    s = make_scheduler(lm)
    s.start()
    yield s
    s.stop()


@pytest.mark.parametrize("max_render_batch, calls", [(1, [[10], [20], [30]]), (2, [[10, 20], [30]])])
def test_renders_run_earliest_deadline_first_batched(lm, max_render_batch, calls):
    scheduler = make_scheduler(lm, max_render_batch=max_render_batch)
    scheduler.start()
    RENDERED.clear()

    async def run():
        gate = threading.Event()
        blocker = asyncio.ensure_future(scheduler.call(gate.wait, deadline=0))
        await asyncio.sleep(0.05)  # the thread is inside the blocking call: the renders queue up
        renders = [asyncio.ensure_future(scheduler.render(d, deadline=float(d))) for d in (30, 10, 20)]
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        return await asyncio.gather(*renders)

    try:
        results = asyncio.run(run())
    finally:
        scheduler.stop()
    assert RENDERED == calls and [r[0] for r in results] == [30, 10, 20]  # each answered with its own audio
    assert scheduler.costs.render_per_audio_s is not None
    assert sum(scheduler.renders.sizes.values()) == len(calls)


def test_past_its_bound_a_submit_is_refused(scheduler):
    async def run():
        gate = threading.Event()
        held = [asyncio.ensure_future(scheduler.call(gate.wait, deadline=0))]
        await asyncio.sleep(0.05)
        held += [asyncio.ensure_future(scheduler.call(lambda: None, deadline=0)) for _ in range(7)]
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded):
            await scheduler.call(lambda: None, deadline=0)
        gate.set()
        await asyncio.gather(*held)
        return scheduler.pending

    assert asyncio.run(run()) == 0


def test_decode_through_the_thread_equals_alone_and_a_cancelled_open_gives_its_slot_back(scheduler, lm):
    text, prompt_text, prompt_speech, seed = REQUESTS[1]

    async def run():
        row = await scheduler.open_row(ras(seed), None, deadline=0)
        await scheduler.call(lambda: scheduler.pool.start(row, unistream(lm, 256, text, prompt_text, prompt_speech)), 0)
        tokens, ended = [], False
        while not ended:
            got, ended = await scheduler.decode(row, 5, deadline=0)
            assert len(got) <= 5
            tokens += got
        scheduler.release(row)
        # all slots taken, then an open is cancelled while it waits: when a slot frees it goes back
        held = [await scheduler.open_row(ras(0), None, 0) for _ in range(2)]
        waiting = asyncio.ensure_future(scheduler.open_row(ras(0), None, 0))
        await asyncio.sleep(0.05)
        waiting.cancel()
        scheduler.release(held[0])
        for _ in range(100):
            await asyncio.sleep(0.01)
            if scheduler.pool.free == 1:
                break
        free_after_cancel = scheduler.pool.free
        scheduler.release(held[1])
        return tokens, free_after_cancel

    tokens, free_after_cancel = asyncio.run(run())
    assert tokens == alone(lm, text, prompt_text, prompt_speech, seed)
    assert free_after_cancel == 1


def test_a_released_row_answers_its_decode_as_ended(scheduler, lm):
    async def run():
        row = await scheduler.open_row(ras(0), None, 0)
        scheduler.release(row)
        await asyncio.sleep(0.05)
        return await scheduler.decode(row, 5, 0)

    assert asyncio.run(run()) == ([], True)


def test_calibration_measures_each_batch_size_and_capacity_follows_the_costs(lm):
    scheduler = Scheduler("test", LMPool(lm, slots=8, max_seq_len=256), render)
    scheduler.calibrate(steps=1)
    assert sorted(scheduler.costs.decode) == [1, 2, 4, 8] and scheduler.pool.free == 8
    costs = StepCosts()
    for batch, seconds in {1: 0.010, 2: 0.012, 4: 0.016, 8: 0.024}.items():
        costs.add_decode(batch, seconds)
    assert costs.decode_step(3) == pytest.approx(0.014) and costs.decode_step(16) == pytest.approx(0.040)
    scheduler.costs = costs
    # 25 steps a second: 8 rows cost 0.6 of the device, within headroom 0.8; but until a render is
    # measured its cost is unknown, and one session at a time is let in
    assert scheduler.capacity() == 1
    costs.add_render(0.0, 10.0)
    assert scheduler.capacity() == 8
    costs.render_per_audio_s = None
    costs.add_render(0.5, 10.0)  # renders cost 0.05 each
    assert costs.load(4, 25, 8) == pytest.approx(25 * 0.016 + 4 * 0.05) and scheduler.capacity() == 6  # 25·0.020 + 6·0.05 = 0.8
    # without batching every session needs its own 25 steps a second: 25 · 0.010 · 2 + 2 · 0.05 = 0.6, 3 sessions 0.9
    scheduler.max_batch = 1
    assert costs.load(2, 25, 1) == pytest.approx(0.6) and scheduler.capacity() == 2


@pytest.mark.parametrize("slots", [64, 20])
def test_calibration_runs_a_step_in_every_graph_bucket(lm, slots):
    """Every bucket a live step can take is captured at start-up (on CUDA: the graph), none while
    sessions wait: with 64 slots the 48 bucket too, with 20 slots the 32 bucket (20 rows padded)."""
    pool = LMPool(lm, slots=slots, max_seq_len=256, graphs=True)
    decoded = []
    original = pool.decode
    pool.decode = lambda rows: decoded.append(len(rows)) or original(rows)
    Scheduler("test", pool, render).calibrate(steps=1)
    assert {decode_bucket(n) for n in decoded} == {b for b in DECODE_BUCKETS if b <= decode_bucket(slots)}


def test_calibration_measures_a_render_before_the_first_reply(lm):
    probes = []

    def probe():
        probes.append([len(probes)])
        return probes[-1]

    scheduler = Scheduler("test", LMPool(lm, slots=8, max_seq_len=256), lambda chunks: [np.zeros(24000, np.float32)])
    scheduler.calibrate(steps=1)
    assert scheduler.costs.render_per_audio_s is None and scheduler.capacity() <= 1  # a cold start admits one
    scheduler.calibrate(steps=1, render_probe=probe)
    assert len(probes) == 2  # fresh chunks for the warm-up and the timed call
    assert scheduler.costs.render_per_audio_s is not None
    scheduler.costs.decode = {1: 0.001, 8: 0.002}  # measured costs that fit every slot: no cap left
    assert scheduler.capacity() == 8


def test_metrics_are_read_from_the_scheduler(lm):
    from prometheus_client import CollectorRegistry, generate_latest

    from voicebot.serving.metrics import register_scheduler_metrics

    scheduler = Scheduler("dev0", LMPool(lm, slots=4, max_seq_len=256), render)
    scheduler.calibrate(steps=1)
    scheduler.batch_sizes[3] += 2
    scheduler.refused += 1
    scheduler.renders.budget_deferrals += 3
    registry = CollectorRegistry()
    register_scheduler_metrics(registry, scheduler)
    text = generate_latest(registry).decode()
    assert 'voicebot_scheduler_decode_steps_total{batch_size="3",scheduler="dev0"} 2.0' in text
    assert 'voicebot_scheduler_refused_total{scheduler="dev0"} 1.0' in text
    assert 'voicebot_scheduler_render_deferrals_total{scheduler="dev0"} 3.0' in text
    assert 'voicebot_scheduler_free_slots{scheduler="dev0"} 4.0' in text
    assert f'voicebot_scheduler_capacity_sessions{{scheduler="dev0"}} {float(scheduler.capacity())}' in text


@pytest.mark.parametrize("decode_deadline", ["later", "sooner"])
def test_a_render_with_slack_waits_for_company_or_more_urgent_decoding_a_due_one_never(lm, decode_deadline):
    """While another row decodes, a render whose listener has a minute of audio left waits up to
    render_hold_steps steps, or, when that row's deadline is sooner, until the row has its tokens;
    one already due (a new reply's first chunk) goes at the next step."""
    scheduler = make_scheduler(lm, render_hold_steps=3)
    steps_at_render: list[int] = []
    scheduler.renders.render = lambda chunks: steps_at_render.append(sum(scheduler.batch_sizes.values())) or [
        np.zeros(10, dtype=np.float32) for _ in chunks]
    # The hold counts from when the scheduler's thread takes the render: on a loaded box the event
    # loop may hand it over several steps after the test asked.
    steps_at_arrival: list[int] = []
    take = scheduler._take

    def taking(incoming):
        steps_at_arrival.extend(sum(scheduler.batch_sizes.values()) for r in incoming if isinstance(r, Render))
        take(incoming)

    scheduler._take = taking
    scheduler.start()

    async def run():
        text, prompt_text, prompt_speech, _ = REQUESTS[1]
        # 10 ms a token: the row is still decoding when the renders arrive, however loaded the box
        # (at full speed its 60 tokens could be done first, and nothing would be there to hold for)
        row = await scheduler.open_row(lambda logp, history: time.sleep(0.01) or int(logp[:60].argmax()), None, 0)
        await scheduler.call(lambda: scheduler.pool.start(row, unistream(lm, 256, text, prompt_text, prompt_speech,
                                                                         min_token_text_ratio=20)), 0)
        deadline = time.monotonic() + (600 if decode_deadline == "later" else 30)
        decoding = asyncio.ensure_future(scheduler.decode(row, 60, deadline))
        await asyncio.sleep(0.05)
        await scheduler.render("due", deadline=0.0)
        due_after = steps_at_render[-1] - steps_at_arrival[-1]
        await scheduler.render("spare", deadline=time.monotonic() + 60)
        held_for = steps_at_render[-1] - steps_at_arrival[-1]
        tokens, _ = await decoding
        scheduler.release(row)
        return due_after, held_for, sum(scheduler.batch_sizes.values()) - steps_at_arrival[-1]

    try:
        due_after, held_for, steps_left = asyncio.run(run())
    finally:
        scheduler.stop()
    assert due_after <= 1  # the step under way when it arrived, at most
    if decode_deadline == "later":
        assert 3 <= held_for <= 4
    else:
        assert held_for == steps_left > 10  # the decoding row went first, all its steps


# ---- the thread outlives what is raised in it ------------------------------------------------------

class DeviceRenders:
    """A render callable as on CUDA: each call returns a Rendering that is ready only once the test
    says so (`finish`), recording the LM steps run while it was in flight."""

    def __init__(self, scheduler_ref: list) -> None:
        self.scheduler_ref, self.calls, self.done = scheduler_ref, [], threading.Event()
        self.steps_at_launch: list[int] = []
        self.steps_at_answer: list[int] = []

    def steps(self) -> int:
        return sum(self.scheduler_ref[0].batch_sizes.values())

    def __call__(self, chunks: list) -> Rendering:
        self.calls.append(list(chunks))
        self.steps_at_launch.append(self.steps())
        done = self.done

        def audio():
            assert done.wait(10), "the test never finished the render"
            self.steps_at_answer.append(self.steps())
            return [np.full(10, chunk, dtype=np.float32) for chunk in chunks]
        return Rendering(ready=done.is_set, audio=audio)


def test_lm_steps_go_on_while_a_render_runs_on_the_device_and_it_is_answered_when_done(lm):
    """A render handed back running (CUDA's side stream) holds no LM step: the decoding row keeps
    stepping until the render is ready; renders arriving meanwhile wait for it and go in one call
    after it; with nothing left to step the thread waits for the device."""
    ref: list = []
    renders = DeviceRenders(ref)
    scheduler = Scheduler("test", LMPool(lm, slots=2, max_seq_len=256, prefill_chunk=8), renders, max_pending=8)
    ref.append(scheduler)
    scheduler.start()

    async def run():
        text, prompt_text, prompt_speech, _ = REQUESTS[1]
        row = await scheduler.open_row(lambda logp, history: int(logp[:60].argmax()), None, 0)
        await scheduler.call(lambda: scheduler.pool.start(row, unistream(lm, 256, text, prompt_text, prompt_speech,
                                                                         min_token_text_ratio=20)), 0)
        decoding = asyncio.ensure_future(scheduler.decode(row, 20, deadline=time.monotonic() + 60))
        first = asyncio.ensure_future(scheduler.render(1, deadline=0.0))
        decoded, _ = await decoding  # stepped while the render ran
        later = [asyncio.ensure_future(scheduler.render(c, deadline=0.0)) for c in (2, 3)]
        await asyncio.sleep(0.1)
        assert len(renders.calls) == 1 and not first.done()  # one render on the device at a time
        renders.done.set()
        audio = [await first] + list(await asyncio.gather(*later))
        scheduler.release(row)
        return decoded, audio

    try:
        decoded, audio = asyncio.run(run())
    finally:
        scheduler.stop()
    assert len(decoded) == 20 and [a[0] for a in audio] == [1, 2, 3]
    assert renders.calls == [[1], [2, 3]]
    # the LM stepped during the render: 20 tokens, the first from the prompt's prefill, 19 from decode steps
    assert renders.steps_at_answer[0] - renders.steps_at_launch[0] >= 10
    assert scheduler.renders.sizes == {1: 1, 2: 1} and scheduler.pending == 0


def test_a_render_in_flight_that_fails_fails_only_its_requests(lm):
    def failing(chunks):
        def audio():
            raise RuntimeError("CUDA error: an illegal memory access")
        return Rendering(ready=lambda: True, audio=audio) if 0 in chunks else render(chunks)

    scheduler = Scheduler("test", LMPool(lm, slots=2, max_seq_len=256), failing, max_render_batch=1)
    scheduler.start()

    async def run():
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await asyncio.wait_for(scheduler.render(0, deadline=0), 10)
        return await asyncio.wait_for(scheduler.render(5, deadline=0), 10)

    try:
        audio = asyncio.run(run())
    finally:
        scheduler.stop()
    assert audio[0] == 5 and scheduler.pending == 0


def raise_into(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Raise `exc` in `thread` at its next Python instruction (as an interpreter shutting a thread
    down, or a C extension's callback, would)."""
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc)) == 1


def test_a_render_that_raises_systemexit_fails_only_its_requests_and_the_scheduler_goes_on(lm):
    def render_or_exit(chunks):
        if "exit" in chunks:
            raise SystemExit("a library called exit()")
        return render(chunks)

    scheduler = Scheduler("test", LMPool(lm, slots=2, max_seq_len=256), render_or_exit, max_render_batch=1)
    scheduler.start()

    async def run():
        with pytest.raises(JobAborted, match="SystemExit: a library called exit"):
            await asyncio.wait_for(scheduler.render("exit", deadline=0), 10)
        return await asyncio.wait_for(scheduler.render(7, deadline=0), 10)

    try:
        audio = asyncio.run(run())
    finally:
        scheduler.stop()
    assert audio[0] == 7 and scheduler.thread_faults == 1 and scheduler.pending == 0


def test_an_exception_raised_into_the_idle_thread_is_survived(scheduler):
    async def run():
        await scheduler.call(lambda: None, deadline=0)  # the thread is up and waiting
        raise_into(scheduler._thread, SystemExit)  # delivered when the next request wakes it
        return await asyncio.wait_for(scheduler.call(lambda: 42, deadline=0), 10)

    assert asyncio.run(run()) == 42
    assert scheduler._thread.is_alive() and scheduler.thread_faults == 1 and scheduler.pending == 0


def test_keyboardinterrupt_raised_into_a_running_call_fails_that_call_only(scheduler):
    async def run():
        gate, entered = threading.Event(), threading.Event()

        def blocking():
            entered.set()
            while not gate.is_set():  # Python instructions: the asynchronous exception lands here
                time.sleep(0.001)

        held = asyncio.ensure_future(scheduler.call(blocking, deadline=0))
        await asyncio.to_thread(entered.wait, 5)
        waiting = asyncio.ensure_future(scheduler.render(3, deadline=0))
        raise_into(scheduler._thread, KeyboardInterrupt)
        with pytest.raises(JobAborted, match="KeyboardInterrupt"):
            await asyncio.wait_for(held, 10)
        gate.set()
        return await asyncio.wait_for(waiting, 10)

    assert asyncio.run(run())[0] == 3
    assert scheduler.thread_faults == 1 and scheduler.pending == 0


def test_a_break_of_the_loop_fails_what_it_held_clearly_and_the_next_turn_works(scheduler, lm, monkeypatch):
    """Something escapes an iteration between steps (here the render step itself breaks) while a
    row decodes and a render waits: both fail with SchedulerFault, the row's session releases it as
    after any failure, and the next utterance decodes as it does alone."""
    text, prompt_text, prompt_speech, seed = REQUESTS[1]
    real_render_step = scheduler.renders.step
    breaks = iter([True])

    def render_step(decoding):
        if scheduler.renders.waiting and next(breaks, False):
            raise KeyboardInterrupt
        real_render_step(decoding)

    monkeypatch.setattr(scheduler.renders, "step", render_step)

    async def open_utterance():
        row = await scheduler.open_row(ras(seed), None, deadline=0)
        await scheduler.call(lambda: scheduler.pool.start(row, unistream(lm, 256, text, prompt_text, prompt_speech)), 0)
        return row

    async def utterance(row):
        try:
            tokens, ended = [], False
            while not ended:
                got, ended = await asyncio.wait_for(scheduler.decode(row, 5, deadline=0), 30)
                tokens += got
            return tokens
        finally:
            scheduler.release(row)

    async def run():
        row = await open_utterance()
        gate = threading.Event()
        blocker = asyncio.ensure_future(scheduler.call(gate.wait, deadline=0))
        await asyncio.sleep(0.05)  # the thread is in the call: the decode and the render arrive together
        decoding = asyncio.ensure_future(utterance(row))
        rendering = asyncio.ensure_future(scheduler.render(1, deadline=0))
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        for held in (decoding, rendering):  # the first iteration prefills, then its render step breaks
            with pytest.raises(SchedulerFault, match="KeyboardInterrupt"):
                await asyncio.wait_for(held, 10)
        return await utterance(await open_utterance())

    assert asyncio.run(run()) == alone(lm, text, prompt_text, prompt_speech, seed)
    assert scheduler.thread_faults == 1 and scheduler.pending == 0 and scheduler.pool.free == 2


def test_a_stopped_scheduler_refuses_new_requests(lm):
    scheduler = make_scheduler(lm)
    scheduler.start()
    scheduler.stop()

    async def run():
        with pytest.raises(RuntimeError, match="stopped"):
            await asyncio.wait_for(scheduler.call(lambda: None, deadline=0), 5)

    asyncio.run(run())
