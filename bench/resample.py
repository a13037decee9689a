"""The mic input resampler (48 kHz -> 16 kHz, voicebot/audio/resample.py): what each soxr quality
holds back per chunk (latency before anything listens) and what it costs in the signal.

    python bench/resample.py

Held back: input not yet returned at the end of each 20 ms chunk, in steady state. Cost: the
complete turns of tests/turn_set.py (espeak-ng, brought to 48 kHz with soxr VHQ, plus white noise
at -40 dBFS as a real mic has above 8 kHz), resampled whole with each quality and compared with
VHQ: the error's power below the reference's, by band (ASR features reach ~7 kHz; above that
is the filter's transition band), and the 32 ms windows where Silero's speech / non-speech
decision differs from its decision on VHQ.
"""

from __future__ import annotations

import numpy as np
import soxr

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.turn_set import TURNS, render  # noqa: E402
from voicebot.audio.endpoint import WINDOW  # noqa: E402
from voicebot.serving.silero import SileroVad  # noqa: E402

IN, OUT = 48000, 16000
CHUNK = IN * 20 // 1000
QUALITIES = ("QQ", "LQ", "MQ", "HQ")
BANDS_HZ = ((0, 4000), (4000, 7000), (7000, 8000))


def held_back_ms(quality: str) -> float:
    stream = soxr.ResampleStream(IN, OUT, 1, dtype="float32", quality=quality)
    audio = np.random.default_rng(0).standard_normal(IN).astype(np.float32) * 0.1
    out = sum(len(stream.resample_chunk(audio[i : i + CHUNK])) for i in range(0, len(audio), CHUNK))
    return (len(audio) * OUT / IN - out) * 1000 / OUT


def speech_decisions(audio: np.ndarray) -> np.ndarray:
    windows = audio[: len(audio) // WINDOW * WINDOW].reshape(-1, WINDOW)
    return SileroVad().probabilities(windows) >= 0.5


def main() -> None:
    rng = np.random.default_rng(0)
    inputs = []
    for item in [t for t in TURNS if not t.pauses_ms]:
        speech = soxr.resample(render(item).audio, OUT, IN, quality="VHQ").astype(np.float32)
        inputs.append(speech + rng.standard_normal(len(speech)).astype(np.float32) * 0.01)
    references = [soxr.resample(x, IN, OUT, quality="VHQ") for x in inputs]
    reference_decisions = [speech_decisions(r) for r in references]
    print(f"{len(inputs)} turns; error power below the VHQ reference's, per band (median over the turns)")
    print(f"{'quality':>7} {'held back':>10} " + " ".join(f"{f'{lo / 1000:g}-{hi / 1000:g} kHz':>11}" for lo, hi in BANDS_HZ)
          + "  Silero decisions changed")
    for quality in QUALITIES:
        per_band, changed, windows = [], 0, 0
        for x, ref, decisions in zip(inputs, references, reference_decisions):
            y = soxr.resample(x, IN, OUT, quality=quality)[: len(ref)]
            spectrum, error = np.fft.rfft(ref), np.fft.rfft(ref - y)
            freqs = np.fft.rfftfreq(len(ref), 1 / OUT)
            per_band.append([10 * np.log10(np.sum(np.abs(spectrum[m]) ** 2) / np.sum(np.abs(error[m]) ** 2))
                             for m in ((freqs >= lo) & (freqs < hi) for lo, hi in BANDS_HZ)])
            changed += int(np.sum(speech_decisions(y) != decisions))
            windows += len(decisions)
        bands = np.median(per_band, axis=0)
        print(f"{quality:>7} {held_back_ms(quality):>7.1f} ms " + " ".join(f"{b:>8.1f} dB" for b in bands)
              + f"  {changed} / {windows}")


if __name__ == "__main__":
    main()
