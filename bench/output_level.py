"""The on-air output stage (voicebot/audio/loudness.py): how close replies come to the loudness
target, their true peak, and what the stage costs on the event loop, per target side by side, and
beside another checkout's stage (`--ref DIR`) on the same chunks.

    python bench/output_level.py [--replies 5] [--ref /tmp/ops_ref]

(A reference: `git archive ops | tar -x -C /tmp/ops_ref`.)

Replies: the same espeak line (tests/audio.py, 24 kHz, peak 0.5: -24.5 LUFS and a peak 18.5 dB
above it, a peaky voice) streamed through one session's OutputLevel in TTS-sized chunks of
0.1-1 s, as the reply path does. Loudness: pyloudnorm's integrated loudness of each reply;
true peak: soxr 4x oversampled. Cost: the CPU time (thread time) of process() per chunk and in
all per second of reply audio, and the wall time per second of audio (what the event loop is held:
on a shared machine the CPU's wait for other work too, an upper bound).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pyloudnorm
import soxr

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.audio import espeak_speech  # noqa: E402
from voicebot.audio import loudness  # noqa: E402
from voicebot.audio.rates import SPEAK_RATE  # noqa: E402
from voicebot.config import OutputConfig  # noqa: E402

LINE = "please tell me a joke about the weather and what time does the show start tomorrow"
SETTINGS = [(-23.0, -1.0), (-18.0, -1.5), (-16.0, -1.0), (-14.0, -1.5), (-14.0, -1.0)]


def stage_of(checkout: Path) -> ModuleType:
    """Another checkout's voicebot/audio/loudness.py, loaded beside this one's."""
    spec = importlib.util.spec_from_file_location("ref_loudness", checkout / "voicebot/audio/loudness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(stage: ModuleType, target: float, ceiling: float, replies: int) -> dict:
    audio = espeak_speech(LINE, rate=SPEAK_RATE).astype(np.float32)
    level = stage.OutputLevel(SPEAK_RATE, OutputConfig(loudness_lufs=target, true_peak_dbtp=ceiling))
    meter = pyloudnorm.Meter(SPEAK_RATE)
    lufs, peaks, chunk_cpu_ms, wall_ms, audio_s = [], [], [], [], 0.0

    def timed(step, *args) -> np.ndarray:
        wall, cpu = time.perf_counter(), time.thread_time()
        result = step(*args)
        chunk_cpu_ms.append((time.thread_time() - cpu) * 1000)
        wall_ms.append((time.perf_counter() - wall) * 1000)
        return result

    for n in range(replies):
        reply, rng, out, i = level.reply(), np.random.default_rng(n), [], 0
        while i < len(audio):
            size = int(rng.integers(SPEAK_RATE // 10, SPEAK_RATE))
            out.append(timed(reply.process, audio[i : i + size]))
            i += size
        out.append(timed(reply.flush))
        sent = np.concatenate(out).astype(np.float64)
        audio_s += len(sent) / SPEAK_RATE
        lufs.append(meter.integrated_loudness(sent))
        peaks.append(20 * np.log10(np.abs(soxr.resample(sent, SPEAK_RATE, 4 * SPEAK_RATE, "VHQ")).max()))
    return {"lufs": lufs, "peak": max(peaks), "chunk_cpu_ms": chunk_cpu_ms,
            "cpu_per_s": sum(chunk_cpu_ms) / audio_s, "wall_per_s": sum(wall_ms) / audio_s}


def row(name: str, r: dict) -> str:
    p50, p95 = np.percentile(r["chunk_cpu_ms"], [50, 95])
    return (f"{name:5s} | {' '.join(f'{x:6.2f}' for x in r['lufs'])} | {r['peak']:5.2f} dBTP"
            f" | {p50:5.2f} / {p95:5.2f} / {max(r['chunk_cpu_ms']):5.2f} | {r['cpu_per_s']:5.2f} | {r['wall_per_s']:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=5)
    parser.add_argument("--ref", type=Path, help="another checkout (e.g. an export of branch ops) to compare with")
    args = parser.parse_args()
    stages = [("this", loudness)] + ([("ref", stage_of(args.ref))] if args.ref else [])
    print(f"as synthesized: {pyloudnorm.Meter(SPEAK_RATE).integrated_loudness(espeak_speech(LINE, rate=SPEAK_RATE).astype(np.float64)):.1f} LUFS")
    print("stage | LUFS of replies 1..n | worst true peak | CPU ms per chunk p50 / p95 / max | CPU ms per s of audio | wall ms per s")
    for target, ceiling in SETTINGS:
        print(f"target {target:.1f} LUFS, ceiling {ceiling:.1f} dBTP")
        results = {name: run(stage, target, ceiling, args.replies) for name, stage in stages}
        for name, r in results.items():
            print(row(name, r))
        if "ref" in results:
            print(f"      ref / this: CPU per s of audio {results['ref']['cpu_per_s'] / results['this']['cpu_per_s']:.1f}x,"
                  f" worst chunk {max(results['ref']['chunk_cpu_ms']) / max(results['this']['chunk_cpu_ms']):.1f}x")


if __name__ == "__main__":
    main()
