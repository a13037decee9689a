"""Frontend features against the official outputs (frontend_golden.safetensors).

Tolerances reached (max abs difference, fp32, 1 thread):
  resample 24k→16k: 0 (bit-exact with torchaudio's Resample)
  prompt mel:       4.8e-7 (values up to ~5)
  whisper log-mel:  1.2e-7
  kaldi fbank:      2.0e-4 raw and after mean removal (kaldi-native-fbank's FFT vs torch's, amplified
                    by the log on low-energy bins; mean error 6.5e-6)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from voicebot.tts.cosyvoice2 import features

pytestmark = pytest.mark.golden


@pytest.fixture(scope="module")
def golden(cv2_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(cv2_dir / "frontend_golden.safetensors")


@pytest.fixture(scope="module")
def meta(cv2_dir: Path) -> dict:
    return json.loads((cv2_dir / "frontend_meta.json").read_text())


def _check(actual: torch.Tensor, expected: torch.Tensor, shape: list[int], atol: float) -> None:
    assert list(actual.shape) == shape == list(expected.shape)
    assert (actual - expected).abs().max().item() <= atol


def test_resample_matches_torchaudio(golden, meta):
    out = features.resample(golden["wav24k"], 24000, 16000)
    _check(out, golden["wav16k_resampled"], meta["wav16k_resampled"], 1e-6)


def test_prompt_mel(golden, meta):
    _check(features.prompt_mel(golden["wav24k"]), golden["speech_feat_24k_80"], meta["speech_feat_24k_80"], 1e-5)


def test_whisper_log_mel(golden, meta):
    out = features.whisper_log_mel(golden["wav16k_resampled"])
    _check(out, golden["whisper_logmel_16k_128"], meta["whisper_logmel_16k_128"], 1e-5)


def test_kaldi_fbank(golden, meta):
    wav = golden["wav16k_resampled"]
    _check(features.kaldi_fbank(wav), golden["kaldi_fbank_16k_80_raw"], meta["kaldi_fbank_16k_80_raw"], 5e-4)
    _check(features.campplus_input(wav), golden["kaldi_fbank_16k_80_cmn"], meta["kaldi_fbank_16k_80_cmn"], 5e-4)

