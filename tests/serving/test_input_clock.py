"""The input clock: every session's chunks through its front end and Silero in one job per tick, each
session's windows and probabilities as its front end and Silero alone would give them, a failing
front end or Silero call failing only its own, and one hand-back per tick."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.audio import dbfs_gain, espeak_speech, fan_noise, to_pcm16
from voicebot.config.stages import EndpointConfig, GateConfig
from voicebot.messages import AudioIn
from voicebot.serving import input_clock as clock_module
from voicebot.serving.input_clock import InputClock, InputClockStopped, InputOverloaded, InputStepFailed
from voicebot.serving.silero import SileroVad
from voicebot.session.listening import FrontEnd

PHRASES = ["what time does the show start", "turn the music down a little", "hello there"]
CHUNK = 320  # 20 ms at 16 kHz


def speech(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    words = dbfs_gain(espeak_speech(PHRASES[seed % len(PHRASES)]), -20 - 3 * seed)
    audio = fan_noise(len(words) + 16000, rng, -50)
    audio[8000 : 8000 + len(words)] += words
    return to_pcm16(audio)


def front_end() -> FrontEnd:
    return FrontEnd(16000, GateConfig(), EndpointConfig())


def alone(pcm: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The windows and probabilities of one front end's prepare and its own Silero, chunk by chunk."""
    front, vad, windows = front_end(), SileroVad(), []
    for start in range(0, len(pcm), 2 * CHUNK):
        windows.append(front.prepare(AudioIn(pcm[start : start + 2 * CHUNK], 0.0))[0])
    windows = np.concatenate(windows)
    return windows, vad.probabilities(windows)


def test_sessions_at_once_get_what_each_alone_would_in_fewer_ticks_than_jobs(input_clock):
    pcms = [speech(seed) for seed in range(3)]

    async def session(pcm: bytes, first_chunk: int) -> tuple[np.ndarray, np.ndarray]:
        front, windows, probabilities = front_end(), [], []
        await asyncio.sleep(first_chunk * 0.02)  # sessions join at different times
        for start in range(0, len(pcm), 2 * CHUNK):
            heard = await input_clock.hear(front, [AudioIn(pcm[start : start + 2 * CHUNK], 0.0)])
            windows.append(heard.windows)
            probabilities.append(heard.probabilities)
        return np.concatenate(windows), np.concatenate(probabilities)

    async def main():
        return await asyncio.gather(*(session(pcm, 5 * k) for k, pcm in enumerate(pcms)))

    results = asyncio.run(main())
    for (windows, probabilities), pcm in zip(results, pcms):
        expected_windows, expected_probabilities = alone(pcm)
        np.testing.assert_array_equal(windows, expected_windows)
        np.testing.assert_allclose(probabilities, expected_probabilities, rtol=0, atol=1e-6)
    assert input_clock.jobs == sum(len(range(0, len(p), 2 * CHUNK)) for p in pcms)
    assert input_clock.ticks < input_clock.jobs  # sessions' chunks of the same tick shared it


def test_its_silero_calls_are_in_the_vad_metrics_by_rows(input_clock):
    """voicebot_vad_calls_total counts the clock's calls with the VAD batcher's (the dashboard's batch sizes)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from voicebot.serving.metrics import register_vad_metrics

    registry = CollectorRegistry()
    register_vad_metrics(registry, input_clock)
    chunk = [AudioIn(speech(0)[: 2 * CHUNK * 5], 0.0)]  # 3 windows a session

    async def main():
        with input_clock._cond:  # both jobs in before the thread can take either: one tick
            jobs = [asyncio.ensure_future(input_clock.hear(front_end(), chunk)) for _ in range(2)]
            await asyncio.sleep(0)
        return await asyncio.gather(*jobs)

    asyncio.run(main())
    text = generate_latest(registry).decode()
    assert 'voicebot_vad_calls_total{batch_size="2"} 3.0' in text and "voicebot_vad_queue_depth 0.0" in text


def test_a_failing_front_end_fails_its_own_job_and_the_others_are_answered(input_clock):
    good, bad = front_end(), front_end()
    bad.prepare = lambda *chunks: (_ for _ in ()).throw(ValueError("bad input"))
    chunk = [AudioIn(speech(0)[: 2 * CHUNK * 5], 0.0)]

    async def main():
        with input_clock._cond:  # both jobs in before the thread can take either: one tick
            jobs = [asyncio.ensure_future(input_clock.hear(f, chunk)) for f in (good, bad)]
            await asyncio.sleep(0)
        return await asyncio.gather(*jobs, return_exceptions=True)

    heard, failed = asyncio.run(main())
    assert len(heard.windows) == len(heard.probabilities) == 3 and isinstance(failed, ValueError)


def test_a_failing_silero_call_fails_its_rows_and_the_clock_goes_on(input_clock, monkeypatch):
    calls = []

    def once_broken(vads, windows):
        calls.append(len(vads))
        if len(calls) == 1:
            raise RuntimeError("onnxruntime broke")
        return real(vads, windows)

    real = clock_module.silero_step
    monkeypatch.setattr(clock_module, "silero_step", once_broken)
    chunk = [AudioIn(speech(1)[: 2 * CHUNK * 5], 0.0)]
    front = front_end()

    async def main():
        with pytest.raises(InputStepFailed, match="onnxruntime broke"):
            await input_clock.hear(front, chunk)
        return await input_clock.hear(front_end(), chunk)

    assert len(asyncio.run(main()).probabilities) == 3


def test_bounds_and_stop():
    clock = InputClock(max_pending=1)  # not started: what is submitted waits
    chunk = [AudioIn(speech(2)[: 2 * CHUNK], 0.0)]

    async def main():
        first = asyncio.ensure_future(clock.hear(front_end(), chunk))
        await asyncio.sleep(0)
        with pytest.raises(InputOverloaded):
            await clock.hear(front_end(), chunk)
        clock.stop()  # told to stop before its thread took the waiting job
        clock.start()
        with pytest.raises(InputClockStopped):
            await first
        with pytest.raises(InputClockStopped):
            await clock.hear(front_end(), chunk)

    asyncio.run(main())
    clock.stop()
