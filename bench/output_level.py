"""The on-air output stage (voicebot/audio/loudness.py): how close replies come to the loudness
target, their true peak, and what the stage costs on the event loop, per target side by side.

    python bench/output_level.py [--replies 5]

Replies: the same espeak line (tests/audio.py, 24 kHz, peak 0.5: -24.5 LUFS and a peak 18.5 dB
above it, a peaky voice) streamed through one session's OutputLevel in TTS-sized chunks of
0.1-1 s, as the reply path does. Loudness: pyloudnorm's integrated loudness of each reply;
true peak: soxr 4x oversampled. Cost: wall time of process() per chunk (it runs on the event
loop) and in all per second of reply audio; on a shared machine an upper bound.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyloudnorm
import soxr

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.audio import espeak_speech  # noqa: E402
from voicebot.audio.loudness import OutputLevel  # noqa: E402
from voicebot.audio.rates import SPEAK_RATE  # noqa: E402
from voicebot.config import OutputConfig  # noqa: E402

LINE = "please tell me a joke about the weather and what time does the show start tomorrow"
SETTINGS = [(-23.0, -1.0), (-18.0, -1.5), (-16.0, -1.0), (-14.0, -1.5), (-14.0, -1.0)]


def run(target: float, ceiling: float, replies: int) -> tuple[list[float], list[float], list[float], float]:
    audio = espeak_speech(LINE, rate=SPEAK_RATE).astype(np.float32)
    level, meter = OutputLevel(SPEAK_RATE, OutputConfig(loudness_lufs=target, true_peak_dbtp=ceiling)), pyloudnorm.Meter(SPEAK_RATE)
    lufs, peaks, chunk_ms, audio_s = [], [], [], 0.0
    for n in range(replies):
        reply, rng, out, i = level.reply(), np.random.default_rng(n), [], 0
        while i < len(audio):
            size = int(rng.integers(SPEAK_RATE // 10, SPEAK_RATE))
            start = time.perf_counter()
            out.append(reply.process(audio[i : i + size]))
            chunk_ms.append((time.perf_counter() - start) * 1000)
            i += size
        out.append(reply.flush())
        sent = np.concatenate(out).astype(np.float64)
        audio_s += len(sent) / SPEAK_RATE
        lufs.append(meter.integrated_loudness(sent))
        peaks.append(20 * np.log10(np.abs(soxr.resample(sent, SPEAK_RATE, 4 * SPEAK_RATE, "VHQ")).max()))
    return lufs, peaks, chunk_ms, sum(chunk_ms) / audio_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=5)
    args = parser.parse_args()
    print(f"as synthesized: {pyloudnorm.Meter(SPEAK_RATE).integrated_loudness(espeak_speech(LINE, rate=SPEAK_RATE).astype(np.float64)):.1f} LUFS")
    print("target / ceiling | LUFS of replies 1..n | worst true peak | ms per chunk p50 / p95 / max | ms per s of audio")
    for target, ceiling in SETTINGS:
        lufs, peaks, chunk_ms, per_s = run(target, ceiling, args.replies)
        p50, p95 = np.percentile(chunk_ms, [50, 95])
        print(f"{target:6.1f} / {ceiling:4.1f} | {' '.join(f'{x:6.2f}' for x in lufs)} | {max(peaks):5.2f} dBTP"
              f" | {p50:5.1f} / {p95:5.1f} / {max(chunk_ms):5.1f} | {per_s:5.1f}")


if __name__ == "__main__":
    main()
