"""Frontend features against the official outputs (frontend_golden.safetensors).

The spectral features are log energies, so a float difference in a bin far below the frame's peak
is amplified by the log: how much depends on the waveform's dynamic range, not on the code. They
are compared where the rounding lives instead, as energies relative to the frame's peak energy
(an FFT's rounding error is relative to the energy of the whole frame). SPECTRUM_RTOL = 1e-4 of
that peak is ~1000 fp32 ulps: far above the rounding of any fp32 FFT, far below a wrong window,
filter, scale or floor. Reached (fp32, 1 thread): prompt mel 2.8e-7, whisper log-mel 1.1e-6, kaldi
fbank 1.6e-5 (kaldi-native-fbank's FFT against torch's); in the log domain the fbank differs by
up to 2.0e-4 on its lowest bins, a number that only describes this waveform.
The resampler is linear: compared relative to the waveform's peak (bit-exact here).
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


SPECTRUM_RTOL = 1e-4  # of each frame's peak energy (see above)
WAVE_RTOL = 1e-6  # of the waveform's peak


def _check_spectrum(actual: torch.Tensor, expected: torch.Tensor, shape: list[int], to_energy, mel_dim: int) -> None:
    """Log-spectral features, compared as energies relative to each frame's peak."""
    assert list(actual.shape) == shape == list(expected.shape)
    got, want = to_energy(actual.double()), to_energy(expected.double())
    frame_peak = want.amax(dim=mel_dim, keepdim=True)
    assert ((got - want).abs() / frame_peak).max().item() <= SPECTRUM_RTOL


def test_resample_matches_torchaudio(golden, meta):
    out, expected = features.resample(golden["wav24k"], 24000, 16000), golden["wav16k_resampled"]
    assert list(out.shape) == meta["wav16k_resampled"] == list(expected.shape)
    assert (out - expected).abs().max().item() <= WAVE_RTOL * expected.abs().max().item()


def test_prompt_mel(golden, meta):
    # log(clamp(mel)), layout (B, T, 80)
    _check_spectrum(features.prompt_mel(golden["wav24k"]), golden["speech_feat_24k_80"],
                    meta["speech_feat_24k_80"], torch.exp, mel_dim=2)


def test_whisper_log_mel(golden, meta):
    # (log10(clamp(mel)) + 4) / 4, layout (B, 128, T)
    _check_spectrum(features.whisper_log_mel(golden["wav16k_resampled"]), golden["whisper_logmel_16k_128"],
                    meta["whisper_logmel_16k_128"], lambda v: 10 ** (4 * v - 4), mel_dim=1)


def test_kaldi_fbank(golden, meta):
    wav = golden["wav16k_resampled"]
    raw = golden["kaldi_fbank_16k_80_raw"]  # natural log, layout (T, 80)
    _check_spectrum(features.kaldi_fbank(wav), raw, meta["kaldi_fbank_16k_80_raw"], torch.exp, mel_dim=1)
    # Mean removal over time: both sides get the official raw mean back, so a wrong mean shows as a
    # per-bin energy scale in the same measure.
    mean = raw.mean(dim=0, keepdim=True)
    _check_spectrum(features.campplus_input(wav) + mean, golden["kaldi_fbank_16k_80_cmn"] + mean,
                    meta["kaldi_fbank_16k_80_cmn"], torch.exp, mel_dim=1)

