"""Fit asr.paraformer.dialect.fallback_threshold on labelled clips from your own show.

Confidence scores from a non-autoregressive decoder are not probabilities of being right, and
the right threshold depends on your speakers, microphones and dialect model: measure it.

Put clips in a folder as pairs `NAME.wav` (mono, any sample rate) + `NAME.txt` (the reference
transcript, UTF-8), a few hundred if you can, covering the accents you expect. Then:

    python scripts/calibrate_threshold.py --config configs/a10.yaml --clips /data/show-clips

Each clip is decoded by the model whose confidence decides the fallback (the offline model when
one is configured, else the streaming model) and by the dialect model. For each candidate
threshold the script prints character accuracy (1 - CER) of the primary and of the dialect model
on the clips below and above it, and the accuracy of the whole system (the fallback applied below
the threshold with the configured `prefer` rule). Pick the threshold with the best system
accuracy, or a higher one if the fallback's added latency matters more to you.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile

from voicebot.asr.funasr_model import Decoded, FunasrModel, utterance_confidence
from voicebot.audio.resample import StreamResampler
from voicebot.config import load_settings
from voicebot.models import ModelRef, resolve

# Punctuation and spaces are not what we are scoring.
_IGNORED = set(" \t\n，。！？、,.!?;；:：\"'“”‘’")


@dataclass
class Clip:
    name: str
    reference: str
    primary: Decoded
    dialect: Decoded

    @property
    def confidence(self) -> float:
        geo_mean, _ = utterance_confidence(self.primary.token_confidences)
        return 0.0 if geo_mean is None else geo_mean


def normalise(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch not in _IGNORED)


def edit_distance(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ca != cb))
    return row[-1]


def accuracy(pairs: list[tuple[str, str]]) -> float:
    """Character accuracy, 1 - CER, pooled over (hypothesis, reference) pairs."""
    errors = sum(edit_distance(normalise(h), normalise(r)) for h, r in pairs)
    length = sum(len(normalise(r)) for _, r in pairs)
    return 1.0 - errors / max(1, length)


def load_clip(path: Path) -> np.ndarray:
    audio, rate = soundfile.read(path, dtype="float32", always_2d=True)
    resampler = StreamResampler(rate, 16000)
    return np.concatenate([resampler.process(audio[:, 0]), resampler.flush()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--clips", required=True, type=Path, help="folder of NAME.wav + NAME.txt pairs")
    args = parser.parse_args()

    conf = load_settings(args.config).asr.paraformer
    if not conf.dialect.model:
        raise SystemExit(f"{args.config}: asr.paraformer.dialect.model is not set; nothing to calibrate")
    primary_key, primary_ref = (("asr.paraformer.offline_model", conf.offline_model) if conf.offline_model
                                else ("asr.paraformer.model", conf.model))
    models = {}
    for role, key, ref in (("primary", primary_key, primary_ref),
                           ("dialect", "asr.paraformer.dialect.model", conf.dialect.model)):
        models[role] = FunasrModel(key, resolve(ModelRef(key, ref, conf.model_cache)), conf.device, conf.threads)
        models[role].load()

    clips = []
    for wav in sorted(args.clips.glob("*.wav")):
        reference_file = wav.with_suffix(".txt")
        if not reference_file.is_file():
            print(f"skipping {wav.name}: no {reference_file.name}")
            continue
        audio = load_clip(wav)
        clips.append(Clip(wav.stem, reference_file.read_text(encoding="utf-8").strip(),
                          models["primary"].decode_blocking(audio), models["dialect"].decode_blocking(audio)))
    if not clips:
        raise SystemExit(f"no NAME.wav + NAME.txt pairs in {args.clips}")

    def system(clip: Clip, threshold: float) -> str:
        if clip.confidence >= threshold:
            return clip.primary.text
        if conf.dialect.prefer == "dialect":
            return clip.dialect.text
        dialect_confidence, _ = utterance_confidence(clip.dialect.token_confidences)
        return clip.dialect.text if (dialect_confidence or 0.0) > clip.confidence else clip.primary.text

    print(f"{len(clips)} clips; primary = {primary_key}, prefer = {conf.dialect.prefer}")
    print("threshold  below: n  primary dialect | above: n  primary dialect | system")
    best: tuple[float, float] | None = None
    for threshold in np.round(np.arange(0.30, 0.96, 0.05), 2):
        below = [c for c in clips if c.confidence < threshold]
        above = [c for c in clips if c.confidence >= threshold]

        def acc(group: list[Clip], which: str) -> str:
            return f"{accuracy([(getattr(c, which).text, c.reference) for c in group]):7.3f}" if group else "      -"

        overall = accuracy([(system(c, threshold), c.reference) for c in clips])
        print(f"   {threshold:.2f}   {len(below):4d}  {acc(below, 'primary')} {acc(below, 'dialect')} | "
              f"{len(above):4d}  {acc(above, 'primary')} {acc(above, 'dialect')} | {overall:.3f}")
        # On a tie the lower threshold wins: fewer fallbacks, less added latency.
        best = max(best or (overall, -threshold), (overall, -threshold))
    print(f"best system accuracy {best[0]:.3f} at fallback_threshold {-best[1]:.2f} "
          f"(primary alone: {accuracy([(c.primary.text, c.reference) for c in clips]):.3f})")


if __name__ == "__main__":
    main()
