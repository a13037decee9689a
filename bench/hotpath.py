"""The server's own cost per 200 ms of audio: protocol checks, resampling, noise gate, endpointing
(Silero VAD) and the output framer, each timed separately, p50 / p99 over a long run.

    python bench/hotpath.py [--seconds 120]

Input: espeak speech and pauses over fan-like noise, 16 kHz, fed in 200 ms chunks as a client
would send them; output: 24 kHz audio through the 200 ms framer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.audio import dbfs_gain, espeak_speech, fan_noise, to_pcm16  # noqa: E402
from voicebot import protocol  # noqa: E402
from voicebot.audio.endpoint import Endpointer  # noqa: E402
from voicebot.audio.framing import Framer  # noqa: E402
from voicebot.audio.gate import NoiseGate  # noqa: E402
from voicebot.audio.resample import StreamResampler, float_to_pcm16, pcm16_to_float  # noqa: E402
from voicebot.config import EndpointConfig, GateConfig  # noqa: E402

CHUNK = 3200  # 200 ms at 16 kHz


def scene(seconds: int) -> bytes:
    rng = np.random.default_rng(0)
    audio = fan_noise(16000 * seconds, rng, -45)
    speech = dbfs_gain(espeak_speech("what time does the show start tomorrow and who is the guest"), -20)
    for start in range(16000, len(audio) - len(speech), len(speech) + 24000):
        audio[start : start + len(speech)] += speech
    return to_pcm16(audio)


def percentiles(samples: list[float]) -> str:
    a = np.array(samples) * 1000
    return f"p50 {np.percentile(a, 50):.3f} ms  p99 {np.percentile(a, 99):.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=120)
    args = parser.parse_args()
    pcm = scene(args.seconds)
    gate, endpointer = NoiseGate(GateConfig()), Endpointer(EndpointConfig())
    resampler = StreamResampler(16000, 16000)
    framer = Framer(24000, 200)
    reply = np.random.default_rng(1).uniform(-0.3, 0.3, 24000 // 5).astype(np.float32)
    costs: dict[str, list[float]] = {k: [] for k in ("protocol", "decode+resample", "gate", "endpoint", "framer", "total")}
    message = json.dumps({"type": "ping", "id": 1})
    for i in range(0, len(pcm) - CHUNK + 1, CHUNK):
        chunk = pcm[i : i + CHUNK]
        t0 = time.perf_counter()
        protocol.check_audio(len(chunk), 16000)
        protocol.parse_text(message)
        t1 = time.perf_counter()
        audio = resampler.process(pcm16_to_float(chunk))
        t2 = time.perf_counter()
        gated = gate.process(audio)
        t3 = time.perf_counter()
        endpointer.process(gated)
        t4 = time.perf_counter()
        for frame in framer.push(reply):
            float_to_pcm16(frame)
        t5 = time.perf_counter()
        for key, cost in zip(costs, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
            costs[key].append(cost)
    print(f"server hot path per 200 ms of audio ({len(costs['total'])} chunks, one core):")
    for key, samples in costs.items():
        print(f"  {key:16s} {percentiles(samples)}")
    print(f"  gate muted {gate.muted_samples / 16000 * 1000:.0f} ms in {args.seconds} s")


if __name__ == "__main__":
    main()
