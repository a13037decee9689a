"""Streaming Paraformer on CPU: per-chunk latency over a long run, RTF, memory per stream,
real-time streams per core, and the latency a dialect fallback adds at the endpoint.

    python bench/asr.py --size large --chunks 2200     # real dimensions (220 M params): ~10 min
    python bench/asr.py --size tiny --chunks 5000      # the tiny test model: overhead only

"large" is a random-weight model with the exact dimensions of paraformer-large-online, built once
into bench-output/ (880 MB): the compute per chunk is the real model's, the text is nonsense.
Everything runs on one torch thread, through the same FunasrModel/ParaformerStream code as the server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time
from pathlib import Path

import numpy as np

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.asr.tiny_models import build_model_dir, synthetic_speech  # noqa: E402
from voicebot.asr.base import SAMPLE_RATE, Hypothesis  # noqa: E402
from voicebot.asr.funasr_model import FunasrModel, state_bytes  # noqa: E402
from voicebot.asr.paraformer import ParaformerRecognizer  # noqa: E402
from voicebot.asr.router import Router  # noqa: E402
from voicebot.config.engines import DialectFallbackConfig, ParaformerConfig  # noqa: E402
from voicebot.models import is_complete  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "bench-output"
CHUNK = 9600  # 600 ms, the decode step of chunk_size [0, 10, 5]


def percentiles(values: list[float]) -> str:
    ms = np.asarray(values) * 1000
    return f"p50 {np.percentile(ms, 50):6.1f} ms  p95 {np.percentile(ms, 95):6.1f} ms  (n={len(ms)})"


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def long_run(recognizer: ParaformerRecognizer, chunks: int, utterance_s: float, audio: np.ndarray) -> None:
    """One stream, `chunks` decode steps, flushed every `utterance_s` (0: never)."""
    stream = recognizer.open()
    # Wall time is what a client sees; process CPU time (one torch thread, an idle loop) is the
    # model's cost alone, and stays meaningful on a machine other work is also using.
    times, cpu_times, cache_peak, fed = [], [], 0, 0
    per_utterance = int(utterance_s * SAMPLE_RATE / CHUNK) if utterance_s else 0
    for i in range(chunks):
        piece = audio[(i * CHUNK) % (len(audio) - CHUNK) :][:CHUNK]
        started, cpu_started = time.perf_counter(), time.process_time()
        await stream.accept(piece)
        if per_utterance and (i + 1) % per_utterance == 0:
            await stream.finish()
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
        cache_peak = max(cache_peak, state_bytes(stream._primary.cache))
        fed += len(piece)
    window = min(1000, chunks // 2)
    print(f"per-chunk latency, first {window} chunks: {percentiles(times[:window])}")
    print(f"per-chunk latency, last  {window} chunks: {percentiles(times[-window:])}")
    print(f"per-chunk CPU time, first {window} chunks: {percentiles(cpu_times[:window])}")
    print(f"per-chunk CPU time, last  {window} chunks: {percentiles(cpu_times[-window:])}")
    audio_s = fed / SAMPLE_RATE
    print(f"real-time factor: {sum(times) / audio_s:.3f} wall, {sum(cpu_times) / audio_s:.3f} CPU, over "
          f"{audio_s / 60:.1f} min of audio ({'flushed every %.0f s' % utterance_s if utterance_s else 'never flushed'})")
    print(f"memory per stream: funasr cache peak {cache_peak / 2**20:.2f} MiB "
          f"(+ {utterance_s * SAMPLE_RATE * 4 / 2**20:.2f} MiB utterance audio when a second pass is configured)")


async def streams_per_core(recognizer: ParaformerRecognizer, audio: np.ndarray, seconds: float) -> None:
    """Real-time streams one worker thread sustains: each fed 600 ms every 600 ms of wall time.

    A count passes when every chunk's result arrives within one chunk duration of its audio
    (so the backlog cannot grow); the largest passing count is the answer.
    """
    best, most = 0, 12
    for count in range(1, most + 1):
        lags: list[float] = []

        async def client(offset: int) -> None:
            stream = recognizer.open()
            start = time.perf_counter()
            for i in range(int(seconds / 0.6)):
                due = start + (i + 1) * 0.6  # the moment this chunk's audio has fully arrived
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                await stream.accept(audio[offset + i * CHUNK :][:CHUNK])
                lags.append(time.perf_counter() - due)
            await stream.finish()

        await asyncio.gather(*(client(k * 7 * CHUNK) for k in range(count)))
        p95 = float(np.percentile(lags, 95))
        ok = p95 < 0.6
        print(f"  {count} streams: result lag {percentiles(lags)}  {'ok' if ok else 'falls behind'}")
        if not ok:
            break
        best = count
    print(f"real-time streams per core: {best}{'+' if best == most else ''}")


async def fallback_latency(model: FunasrModel, audio: np.ndarray) -> None:
    """Time the dialect decode a fallback adds at the endpoint, for typical utterance lengths."""
    print(f"fallback to a {model.class_name} model:")
    router = Router(dialect=model, threshold=1.0)  # threshold 1: always falls back
    unsure = Hypothesis(text="x", confidence=0.5, model="primary")
    for seconds in (2.0, 5.0, 10.0):
        clip = audio[: int(seconds * SAMPLE_RATE)]
        times, cpu_times = [], []
        for _ in range(3):
            started, cpu_started = time.perf_counter(), time.process_time()
            await router.finalize(unsure, clip)
            times.append(time.perf_counter() - started)
            cpu_times.append(time.process_time() - cpu_started)
        print(f"  fallback on a {seconds:4.1f} s utterance adds {min(times) * 1000:7.1f} ms "
              f"({min(cpu_times) * 1000:.1f} ms CPU; best of 3)")


async def parallel_fallback(plain: ParaformerRecognizer, parallel: ParaformerRecognizer, audio: np.ndarray) -> None:
    """With dialect.parallel the fallback's cost at the endpoint is a flush, whatever the length."""
    print("fallback with dialect.parallel (dialect streamed alongside), endpoint time vs no fallback:")
    for seconds in (2.0, 5.0, 10.0):
        clip = audio[: int(seconds * SAMPLE_RATE)]
        finish: dict[str, float] = {}
        for name, recognizer in (("plain", plain), ("parallel", parallel)):
            for _ in range(3):
                stream = recognizer.open()
                for start in range(0, len(clip), CHUNK):
                    await stream.accept(clip[start : start + CHUNK])
                started = time.perf_counter()
                await stream.finish()
                finish[name] = min(finish.get(name, 1e9), time.perf_counter() - started)
        print(f"  {seconds:4.1f} s utterance: finish {finish['plain'] * 1000:7.1f} ms without a dialect model, "
              f"{finish['parallel'] * 1000:7.1f} ms with a parallel fallback (best of 3)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "large"), default="tiny")
    parser.add_argument("--chunks", type=int, default=2200, help="decode steps in the long run")
    parser.add_argument("--utterance-s", type=float, default=10.0, help="flush every N s (0: never)")
    parser.add_argument("--streams-s", type=float, default=12.0, help="wall seconds per streams-per-core trial")
    parser.add_argument("--skip", nargs="*", default=[], choices=("long", "streams", "fallback"))
    args = parser.parse_args()

    import funasr  # noqa: F401  (imported first, so its 0.3 GB is not counted as the model's)
    import torch

    torch.set_num_threads(1)
    model_dir = OUT / f"paraformer-streaming-{args.size}"
    if not is_complete(model_dir):
        started = time.perf_counter()
        build_model_dir(model_dir, "paraformer-streaming", size=args.size)
        print(f"built {model_dir} in {time.perf_counter() - started:.0f} s")
    rss_before = rss_mib()
    started = time.perf_counter()
    recognizer = ParaformerRecognizer(ParaformerConfig(model=str(model_dir)))
    recognizer.load()
    print(f"{args.size}: loaded in {time.perf_counter() - started:.1f} s, RSS +{rss_mib() - rss_before:.0f} MiB "
          f"(peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    audio = synthetic_speech(120.0, seed=7)

    if "long" not in args.skip:
        asyncio.run(long_run(recognizer, args.chunks, args.utterance_s, audio))
    if "streams" not in args.skip:
        asyncio.run(streams_per_core(recognizer, audio, args.streams_s))
    # A streaming-class dialect model decodes the utterance chunk by chunk; an offline-class one
    # (whose cost is also that of the offline second pass) in one forward pass.
    if "fallback" not in args.skip:
        asyncio.run(fallback_latency(recognizer.streaming, audio))
        # The same weights as dialect model, unsure by construction (threshold 1: always falls back).
        dialect = DialectFallbackConfig(model=str(model_dir), fallback_threshold=0.999, parallel=True)
        parallel = ParaformerRecognizer(ParaformerConfig(model=str(model_dir), dialect=dialect))
        parallel.load()
        asyncio.run(parallel_fallback(recognizer, parallel, audio))
        parallel.close()
    recognizer.close()
    if "fallback" not in args.skip:
        offline_dir = OUT / f"paraformer-{args.size}"
        if not is_complete(offline_dir):
            build_model_dir(offline_dir, "paraformer", size=args.size)
        offline = FunasrModel("offline", offline_dir)
        offline.load()
        asyncio.run(fallback_latency(offline, audio))
        offline.close()


if __name__ == "__main__":
    main()
