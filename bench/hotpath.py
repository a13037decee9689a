"""The server's own cost per 200 ms of audio: protocol checks, resampling, noise gate, endpointing
(Silero VAD) and the output framer, each timed separately, p50 / p99 over a long run. Then Silero's
cost per window with 1, 8 and 32 streams: one onnxruntime call per stream and window, one call per
step for all streams (silero_step), and through the VAD batcher's thread (voicebot/serving/vad.py:
each stream submits a 200 ms chunk, 6 windows, and waits), measured alternately in one run.

    python bench/hotpath.py [--seconds 120] [--streams 1,8,32]

Input: espeak speech and pauses over fan-like noise, 16 kHz, fed in 200 ms chunks as a client
would send them; output: 24 kHz audio through the 200 ms framer.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.audio import dbfs_gain, espeak_speech, fan_noise, to_pcm16  # noqa: E402
from voicebot import protocol  # noqa: E402
from voicebot.audio.endpoint import WINDOW, Endpointer  # noqa: E402
from voicebot.audio.framing import Framer  # noqa: E402
from voicebot.audio.gate import NoiseGate  # noqa: E402
from voicebot.audio.resample import StreamResampler, float_to_pcm16, pcm16_to_float  # noqa: E402
from voicebot.config.stages import EndpointConfig, GateConfig  # noqa: E402
from voicebot.serving.silero import SileroVad, silero_step  # noqa: E402
from voicebot.serving.vad import VadBatcher  # noqa: E402

CHUNK = 3200  # 200 ms at 16 kHz
CHUNK_WINDOWS = CHUNK // WINDOW  # 6 whole windows


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


def vad_per_window(audio: np.ndarray, streams: int, rounds: int, batcher: VadBatcher) -> dict[str, tuple[float, float]]:
    """(CPU, wall) seconds per window of each way, medians over `rounds` chunks of CHUNK_WINDOWS
    windows per stream; the ways take turns chunk by chunk, in a rotating order (a shared machine's
    load drifts). CPU is the process's, every thread's: the batcher's thread counts."""
    windows = audio[: len(audio) // WINDOW * WINDOW].reshape(-1, WINDOW)
    # Stream i hears the scene from its own offset, so the streams are not in step.
    offsets = [i * len(windows) // streams for i in range(streams)]

    def one_call_each(vads, chunks):
        for vad, chunk in zip(vads, chunks):
            vad.probabilities(chunk)

    def one_call_per_step(vads, chunks):
        for k in range(CHUNK_WINDOWS):
            silero_step(vads, np.stack([c[k] for c in chunks]))

    def through_the_batcher(vads, chunks):
        for future in [batcher.submit(vad, chunk) for vad, chunk in zip(vads, chunks)]:
            future.result()

    ways = {"one call each": one_call_each, "one call per step": one_call_per_step, "batcher": through_the_batcher}
    vads = {way: [SileroVad() for _ in range(streams)] for way in ways}
    times: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    for r in range(rounds):
        chunks = [windows.take(range(o + r * CHUNK_WINDOWS, o + (r + 1) * CHUNK_WINDOWS), axis=0, mode="wrap")
                  for o in offsets]
        names = list(ways)
        for way in names[r % 3 :] + names[: r % 3]:
            cpu, wall = time.process_time(), time.perf_counter()
            ways[way](vads[way], chunks)
            n = streams * CHUNK_WINDOWS
            times[way].append(((time.process_time() - cpu) / n, (time.perf_counter() - wall) / n))
    return {way: tuple(np.median(np.array(t), axis=0)) for way, t in times.items()}


def print_vad(audio: np.ndarray, counts: list[int]) -> None:
    batcher = VadBatcher()
    batcher.start()
    try:
        print(f"\nSilero VAD per window, CPU us / wall us (medians), one onnxruntime thread, load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; (x): one call each / this, CPU:")
        for streams in counts:
            cost = vad_per_window(audio, streams, rounds=max(10, 600 // streams), batcher=batcher)
            alone = cost["one call each"][0]
            print(f"  {streams:3d} streams  " + "  ".join(f"{way} {1e6 * cpu:5.0f} / {1e6 * wall:5.0f} ({alone / cpu:4.2f}x)"
                                                      for way, (cpu, wall) in cost.items()), flush=True)
        print(f"  batcher rows per call: {dict(sorted(batcher.batch_sizes.items()))}")
    finally:
        batcher.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=120)
    parser.add_argument("--streams", default="1,8,32", help="stream counts of the VAD figures ('' for none)")
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
    print_vad(pcm16_to_float(pcm), [int(n) for n in args.streams.split(",") if n])


if __name__ == "__main__":
    main()
