"""The on-air output stage (voicebot/audio/loudness.py): how close replies come to the loudness
target, their true peak, and what the stage costs on the event loop, per target side by side, and
beside another checkout's stage (`--ref DIR`) on the same chunks.

    python bench/output_level.py [--replies 5] [--ref /tmp/ops_ref]

(A reference: `git archive ops | tar -x -C /tmp/ops_ref`.)

Replies: the same espeak line (tests/audio.py, 24 kHz, peak 0.5: -24.5 LUFS and a peak 18.5 dB
above it, a peaky voice) streamed through one session's OutputLevel in TTS-sized chunks of
0.1-1 s, as the reply path does (on the event loop: voicebot/session/replying.py). Loudness:
pyloudnorm's integrated loudness of each reply; true peak: soxr 4x oversampled. Cost, each as
p50 / p95 / max: the CPU (thread) time of each chunk per 200 ms frame of its audio, the CPU time of
a whole reply, and the wall time each call holds the event loop (on a shared machine the wait for
a core too: an upper bound).
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
from voicebot.config.stages import OutputConfig  # noqa: E402

LINE = "please tell me a joke about the weather and what time does the show start tomorrow"
SETTINGS = [(-23.0, -1.0), (-18.0, -1.5), (-16.0, -1.0), (-14.0, -1.5), (-14.0, -1.0)]
FRAME_S = 0.2  # the session's output frame


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
    lufs, peaks, calls, per_reply = [], [], [], []  # calls: (CPU ms, wall ms, samples) of each process()/flush()

    def timed(step, *args) -> np.ndarray:
        wall, cpu = time.perf_counter(), time.thread_time()
        result = step(*args)
        calls.append(((time.thread_time() - cpu) * 1000, (time.perf_counter() - wall) * 1000, len(args[0]) if args else 0))
        return result

    for n in range(replies):
        reply, rng, out, i, first_call = level.reply(), np.random.default_rng(n), [], 0, len(calls)
        while i < len(audio):
            size = int(rng.integers(SPEAK_RATE // 10, SPEAK_RATE))
            out.append(timed(reply.process, audio[i : i + size]))
            i += size
        out.append(timed(reply.flush))
        sent = np.concatenate(out).astype(np.float64)
        per_reply.append(sum(c[0] for c in calls[first_call:]))
        lufs.append(meter.integrated_loudness(sent))
        peaks.append(20 * np.log10(np.abs(soxr.resample(sent, SPEAK_RATE, 4 * SPEAK_RATE, "VHQ")).max()))
    chunks = [(cpu, wall, samples) for cpu, wall, samples in calls if samples]
    return {"lufs": lufs, "peak": max(peaks), "reply_s": len(audio) / SPEAK_RATE, "per_reply_cpu_ms": per_reply,
            # Each chunk's cost as if it were one 200 ms frame of audio (its cost x 200 ms / its length).
            "frame_cpu_ms": [cpu * FRAME_S * SPEAK_RATE / samples for cpu, _, samples in chunks],
            "call_wall_ms": [wall for _, wall, _ in calls]}


def row(name: str, r: dict) -> str:
    def p(values) -> str:
        return " / ".join(f"{v:5.2f}" for v in (*np.percentile(values, [50, 95]), max(values)))

    return (f"{name:5s} | {' '.join(f'{x:6.2f}' for x in r['lufs'])} | {r['peak']:5.2f} | {p(r['frame_cpu_ms'])}"
            f" | {p(r['per_reply_cpu_ms'])} | {p(r['call_wall_ms'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=5)
    parser.add_argument("--ref", type=Path, help="another checkout (e.g. an export of branch ops) to compare with")
    args = parser.parse_args()
    stages = [("this", loudness)] + ([("ref", stage_of(args.ref))] if args.ref else [])
    print(f"as synthesized: {pyloudnorm.Meter(SPEAK_RATE).integrated_loudness(espeak_speech(LINE, rate=SPEAK_RATE).astype(np.float64)):.1f} LUFS")
    print("stage | LUFS of replies 1..n | worst true peak dBTP | CPU ms per 200 ms frame | CPU ms per reply"
          " | wall ms the loop is held per call    (p50 / p95 / max each)")
    for target, ceiling in SETTINGS:
        print(f"target {target:.1f} LUFS, ceiling {ceiling:.1f} dBTP")
        results = {name: run(stage, target, ceiling, args.replies) for name, stage in stages}
        for name, r in results.items():
            print(row(name, r))
        print(f"      (a reply is {results['this']['reply_s']:.1f} s of audio, {FRAME_S * 1000:.0f} ms a frame)")


if __name__ == "__main__":
    main()
