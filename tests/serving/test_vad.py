"""The VAD batcher: every stream's windows in shared onnxruntime calls, each stream's probabilities
as its own calls alone would give them."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import threading
import time

import numpy as np
import pytest

from tests.audio import dbfs_gain, espeak_speech, fan_noise, to_pcm16
from voicebot.audio.endpoint import WINDOW, Endpointer, VadEvent
from voicebot.audio.resample import pcm16_to_float
from voicebot.config.stages import EndpointConfig, GateConfig
from voicebot.frontends.funasr_ws import funasr_segmenter
from voicebot.messages import AudioIn
from voicebot.serving.silero import SileroVad
from voicebot.serving.vad import VadBatcher, VadFault, VadOverloaded
from voicebot.serving.batcher import StepFailed
from voicebot.session.listening import FrontEnd

PHRASES = ["what time does the show start", "turn the music down a little", "hello there", "who is the guest tonight"]


@functools.cache
def stream_audio(seed: int) -> np.ndarray:
    """Speech over noise with pauses (both speech and silence windows), a different take per seed."""
    rng = np.random.default_rng(seed)
    speech = dbfs_gain(espeak_speech(PHRASES[seed % len(PHRASES)]), -20 - 3 * seed)
    audio = fan_noise(len(speech) + 16000, rng, -50)
    audio[8000 : 8000 + len(speech)] += speech
    return audio[: len(audio) // WINDOW * WINDOW].reshape(-1, WINDOW)


def chunks(windows: np.ndarray, seed: int) -> list[np.ndarray]:
    """The windows in chunks of 0 to 7 (as clients' chunk sizes differ; 0: a chunk shorter than a window)."""
    sizes = np.random.default_rng(100 + seed).integers(0, 8, len(windows))
    cuts = np.cumsum(sizes)
    return np.split(windows, cuts[cuts < len(windows)])


def test_a_stream_in_a_batch_gets_the_probabilities_of_its_calls_alone(batcher):
    """Streams join (staggered first rounds) and leave (different lengths) while others are judged;
    each round's chunks are submitted together, so steps hold several streams and, with max_batch 4
    of 6 streams, some rows wait a step."""
    streams = [stream_audio(seed) for seed in range(6)]
    alone = [SileroVad().probabilities(w) for w in streams]
    pieces = [[np.zeros((0, WINDOW), np.float32)] * (2 * seed) + chunks(w, seed) for seed, w in enumerate(streams)]
    vads = [SileroVad() for _ in streams]
    got: list[list[np.ndarray]] = [[] for _ in streams]
    for round_ in range(max(map(len, pieces))):
        live = [i for i in range(len(streams)) if round_ < len(pieces[i])]
        with batcher._cond:  # hold the thread until the round is in, so it is batched as one
            futures = {i: batcher.submit(vads[i], pieces[i][round_]) for i in live}
        for i, future in futures.items():
            got[i].append(future.result(timeout=30))
    for i, expected in enumerate(alone):
        np.testing.assert_allclose(np.concatenate(got[i]), expected, rtol=0, atol=1e-6)
    assert max(batcher.batch_sizes) == 4 and len(batcher.batch_sizes) > 1
    assert all(a.max() > 0.5 and a.min() < 0.1 for a in alone)  # speech and silence both judged
    assert batcher.pending == 0


def test_concurrent_sessions_on_the_event_loop(batcher):
    streams = [stream_audio(seed) for seed in range(3)]

    async def session(seed: int, windows: np.ndarray) -> np.ndarray:
        vad, out = SileroVad(), []
        await asyncio.sleep(0.01 * seed)  # join at different times
        for chunk in chunks(windows, seed):
            out.append(await batcher.probabilities(vad, chunk))
        return np.concatenate(out)

    async def main():
        return await asyncio.gather(*(session(seed, w) for seed, w in enumerate(streams)))

    for got, windows in zip(asyncio.run(main()), streams):
        np.testing.assert_allclose(got, SileroVad().probabilities(windows), rtol=0, atol=1e-6)


def test_bounds_one_request_per_stream_and_max_pending():
    batcher = VadBatcher(max_pending=2)  # not started: requests stay waiting
    windows = np.zeros((3, WINDOW), np.float32)
    vad = SileroVad()
    batcher.submit(vad, windows)
    with pytest.raises(RuntimeError, match="one request per stream"):
        batcher.submit(vad, windows)
    batcher.submit(SileroVad(), windows)
    with pytest.raises(VadOverloaded):
        batcher.submit(SileroVad(), windows)
    assert batcher.pending == 2


def test_waiting_requests_fail_when_it_stops():
    batcher = VadBatcher()
    batcher.start()
    with batcher._cond:
        future = batcher.submit(SileroVad(), np.zeros((2, WINDOW), np.float32))
        batcher._stopping = True
        batcher._cond.notify()
    with pytest.raises(RuntimeError, match="stopped"):
        future.result(timeout=5)


def test_metrics_count_calls_by_rows(batcher):
    from prometheus_client import CollectorRegistry, generate_latest

    from voicebot.serving.metrics import register_vad_metrics

    registry = CollectorRegistry()
    register_vad_metrics(registry, batcher)
    vads = [SileroVad(), SileroVad()]
    with batcher._cond:
        futures = [batcher.submit(v, np.zeros((2, WINDOW), np.float32)) for v in vads]
    for future in futures:
        future.result(timeout=30)
    text = generate_latest(registry).decode()
    assert 'voicebot_vad_calls_total{batch_size="2"} 2.0' in text and "voicebot_vad_queue_depth 0.0" in text


def test_a_session_that_goes_away_mid_chunk_leaves_the_others_judged(batcher):
    """Its task is cancelled while its windows wait (asyncio passes the cancel on to the request)."""
    windows = stream_audio(0)[:6]

    async def main():
        with batcher._cond:  # the thread cannot take it before the cancel
            gone = asyncio.ensure_future(batcher.probabilities(SileroVad(), windows))
            await asyncio.sleep(0)
            gone.cancel()
            await asyncio.sleep(0)
        return await asyncio.wait_for(batcher.probabilities(SileroVad(), windows), 30)

    np.testing.assert_allclose(asyncio.run(main()), SileroVad().probabilities(windows), rtol=0, atol=1e-6)
    assert batcher.pending == 0 and batcher._thread.is_alive()


# ---- /funasr streams (voicebot/frontends/funasr_ws.py) on the same batcher as /v1/voice sessions ----------

def recorded(endpointer: Endpointer) -> list[np.ndarray]:
    """The probabilities the endpoint rule is given, call by call."""
    seen, decide = [], endpointer.decide

    def record(windows, probabilities, *hidden):  # hidden: what the echo canceller's suppressor hid
        seen.append(np.asarray(probabilities))
        return decide(windows, probabilities, *hidden)

    endpointer.decide = record
    return seen


def event_shape(events: list[VadEvent]) -> list[tuple[str, int]]:
    return [(e.kind.value, len(e.audio)) for e in events]


def test_funasr_and_voice_streams_at_once_are_each_judged_as_alone(batcher, input_clock):
    """Two /funasr segmenters (on the VAD batcher) and two /v1/voice front ends (on the input clock)
    at once, chunks of different sizes (one over the 1 s a request holds): each stream's
    probabilities and endpoint events equal its endpointer run alone, one call per window."""
    endpoint = EndpointConfig()
    pcm = [to_pcm16(stream_audio(seed).reshape(-1)) for seed in range(4)]
    heard = [pcm16_to_float(p) for p in pcm]  # what both routes judge once the PCM is read

    def alone(audio: np.ndarray, chunk: int) -> tuple[np.ndarray, list]:
        endpointer = Endpointer(endpoint)
        seen = recorded(endpointer)
        events = []
        for start in range(0, len(audio), chunk):
            events += endpointer.process(audio[start : start + chunk])
        return np.concatenate(seen), event_shape(events + endpointer.force_end())

    async def funasr(audio: np.ndarray, chunk: int):
        segmenter = funasr_segmenter(object(), endpoint, batcher)  # no fsmn-vad: the Silero endpointer
        seen = recorded(segmenter.endpointer)
        events = []
        for start in range(0, len(audio), chunk):
            events += await segmenter.process(audio[start : start + chunk])
        return np.concatenate(seen), event_shape(events + await segmenter.force_end())

    async def voice(data: bytes, chunk: int):
        front = FrontEnd(16000, GateConfig(enabled=False), endpoint)
        seen = recorded(front.endpointer)
        events = []
        for start in range(0, len(data), 2 * chunk):
            events += (await front.process(AudioIn(data[start : start + 2 * chunk], time.monotonic()), input_clock)).events
        return np.concatenate(seen), event_shape(events + front.end())

    chunk_sizes = [40000, 3000, 1600, 5000]  # samples: 2.5 s (cut into 1 s requests), 190 ms, 100 ms, 310 ms

    async def main():
        return await asyncio.gather(funasr(heard[0], chunk_sizes[0]), funasr(heard[1], chunk_sizes[1]),
                                    voice(pcm[2], chunk_sizes[2]), voice(pcm[3], chunk_sizes[3]))

    results = asyncio.run(main())
    for (probabilities, events), audio, chunk in zip(results, heard, chunk_sizes):
        expected_probabilities, expected_events = alone(audio, chunk)
        np.testing.assert_allclose(probabilities, expected_probabilities, rtol=0, atol=1e-6)
        assert events == expected_events and any(kind == "end" for kind, _ in events)
    assert max(batcher.batch_sizes) >= 2  # the /funasr streams' windows shared calls
    assert batcher.pending == 0


@pytest.mark.parametrize("when", ["waiting", "being_judged"])
def test_a_funasr_client_gone_mid_chunk_leaves_vad_to_the_others(batcher, when, monkeypatch):
    """The connection's task is cancelled while its chunk's windows wait or are being judged: the
    other streams are judged as alone and the batcher goes on."""
    from voicebot.serving import vad as vad_module

    endpoint = EndpointConfig()
    audio = stream_audio(0).reshape(-1)
    other = stream_audio(1)[:20]
    judging, cancelled = threading.Event(), threading.Event()
    real_step = vad_module.silero_step

    def step_held(vads, windows):  # a step holds until the test has cancelled (waited for at most 30 s)
        judging.set()
        cancelled.wait(30)
        return real_step(vads, windows)

    async def main():
        gone = funasr_segmenter(object(), endpoint, batcher)
        if when == "waiting":
            with batcher._cond:  # the thread cannot take it before the cancel
                task = asyncio.ensure_future(gone.process(audio[:16000]))
                await asyncio.sleep(0)
                task.cancel()
                await asyncio.sleep(0)
        else:
            # Held in its first step: on a loaded box an unheld step could judge the whole second
            # before the cancel, and the task would end normally.
            monkeypatch.setattr(vad_module, "silero_step", step_held)
            task = asyncio.ensure_future(gone.process(audio[:16000]))
            for _ in range(30_000):
                if judging.is_set():
                    break
                await asyncio.sleep(0.001)
            task.cancel()
            await asyncio.sleep(0)
        cancelled.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await asyncio.wait_for(batcher.probabilities(SileroVad(), other), 30)

    np.testing.assert_allclose(asyncio.run(main()), SileroVad().probabilities(other), rtol=0, atol=1e-6)
    deadline = time.monotonic() + 5
    while batcher.pending and time.monotonic() < deadline:  # a running request finishes its windows
        time.sleep(0.01)
    assert batcher.pending == 0 and batcher._thread.is_alive()


# ---- the thread outlives what is raised in it ------------------------------------------------------

def test_a_step_raising_systemexit_fails_its_rows_only_and_the_batcher_goes_on(batcher, monkeypatch):
    from voicebot.serving import vad as vad_module

    real_step, calls = vad_module.silero_step, []

    def step_or_exit(vads, windows):
        calls.append(len(vads))
        if len(calls) == 1:
            raise SystemExit("a library called exit()")
        return real_step(vads, windows)

    monkeypatch.setattr(vad_module, "silero_step", step_or_exit)
    windows = stream_audio(0)[:4]
    with pytest.raises(StepFailed, match="SystemExit"):
        batcher.submit(SileroVad(), windows).result(timeout=10)
    np.testing.assert_allclose(batcher.submit(SileroVad(), windows).result(timeout=10), SileroVad().probabilities(windows),
                               rtol=0, atol=1e-6)
    assert batcher.thread_faults == 1 and batcher.pending == 0


def test_an_exception_raised_into_the_idle_thread_is_survived(batcher):
    windows = stream_audio(1)[:3]
    batcher.submit(SileroVad(), windows).result(timeout=10)  # the thread is up and waiting
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(batcher._thread.ident),
                                                      ctypes.py_object(SystemExit)) == 1
    got = batcher.submit(SileroVad(), windows).result(timeout=10)  # wakes it: the exception lands in the wait
    np.testing.assert_allclose(got, SileroVad().probabilities(windows), rtol=0, atol=1e-6)
    assert batcher._thread.is_alive() and batcher.thread_faults == 1 and batcher.pending == 0


def test_a_break_of_the_loop_fails_what_it_held_clearly_and_the_stream_goes_on(batcher, monkeypatch):
    real_running, breaks = batcher._running, iter([True])

    def running(incoming):
        if incoming and next(breaks, False):
            raise KeyboardInterrupt
        return real_running(incoming)

    monkeypatch.setattr(batcher, "_running", running)
    vad, windows = SileroVad(), stream_audio(2)[:5]
    with pytest.raises(VadFault, match="KeyboardInterrupt"):
        batcher.submit(vad, windows).result(timeout=10)
    batcher.submit(vad, windows).result(timeout=10)  # the stream's next chunk is taken (one in flight at a time)
    assert batcher.thread_faults == 1 and batcher.pending == 0 and batcher._thread.is_alive()
