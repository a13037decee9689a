"""Audio features of the CosyVoice 2 frontend (spec §5.2–5.4), without torchaudio or librosa.

Each function reproduces the reference implementation the released model was trained with:
torchaudio's sinc resampler, Matcha's prompt mel, whisper's log-mel and Kaldi's fbank. Their
tolerances against the official outputs are asserted in tests/cosyvoice2/test_frontend_golden.py.
"""

from __future__ import annotations

import functools
import math

import kaldi_native_fbank as knf
import numpy as np
import torch
import torch.nn.functional as F

PROMPT_SAMPLE_RATE = 24000  # prompt mel and output audio
TOKENIZER_SAMPLE_RATE = 16000  # speech tokenizer and campplus


# --- resampling: torchaudio.transforms.Resample defaults (sinc_interp_hann, width 6, rolloff 0.99)


@functools.lru_cache(maxsize=8)
def _sinc_kernel(orig: int, new: int, width: int, rolloff: float) -> tuple[torch.Tensor, int]:
    # The kernel is built in float64 and rounded to float32 once, as torchaudio does.
    base_freq = min(orig, new) * rolloff
    pad = math.ceil(width * orig / base_freq)
    idx = torch.arange(-pad, pad + orig, dtype=torch.float64)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx
    t = (t * base_freq).clamp(-width, width)
    window = torch.cos(t * math.pi / width / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
    return (sinc * window * (base_freq / orig)).to(torch.float32), pad


def resample(wav: torch.Tensor, orig_sr: int, new_sr: int, width: int = 6, rolloff: float = 0.99) -> torch.Tensor:
    """Resample (..., N) float audio; same algorithm and output length as torchaudio's Resample."""
    if orig_sr == new_sr:
        return wav
    g = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // g, new_sr // g
    kernel, pad = _sinc_kernel(orig, new, width, rolloff)
    shape = wav.shape
    x = F.pad(wav.reshape(-1, shape[-1]), (pad, pad + orig))
    y = F.conv1d(x[:, None], kernel.to(wav.dtype), stride=orig).transpose(1, 2).reshape(x.shape[0], -1)
    return y[:, : math.ceil(new * shape[-1] / orig)].reshape(*shape[:-1], -1)


# --- mel filterbank: librosa.filters.mel(htk=False, norm="slaney")


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    # Slaney scale: linear below 1 kHz, logarithmic above.
    log_part = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (math.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log_part, f * 3.0 / 200.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp((math.log(6.4) / 27.0) * (m - 15.0)), m * 200.0 / 3.0)


@functools.lru_cache(maxsize=8)
def mel_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> torch.Tensor:
    """(n_mels, n_fft // 2 + 1) float32 slaney-normalised triangles, equal to librosa's."""
    fmax = sr / 2 if fmax is None else fmax
    fft_freqs = np.fft.rfftfreq(n_fft, 1.0 / sr)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper)).astype(np.float32)
    weights *= (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None].astype(np.float32)
    return torch.from_numpy(weights)


# --- the three feature extractors


def prompt_mel(wav24k: torch.Tensor) -> torch.Tensor:
    """(1, N) 24 kHz → (1, N // 480, 80) natural-log mel: the flow's prompt_feat (Matcha's extractor)."""
    n_fft, hop = 1920, 480
    x = F.pad(wav24k[:, None], ((n_fft - hop) // 2, (n_fft - hop) // 2), mode="reflect")[:, 0]
    spec = torch.stft(x, n_fft, hop, n_fft, torch.hann_window(n_fft, dtype=x.dtype), center=False, return_complex=True)
    mag = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    mel = mel_filterbank(PROMPT_SAMPLE_RATE, n_fft, 80, 0.0, 8000.0) @ mag
    return torch.log(mel.clamp(min=1e-5)).transpose(1, 2)


def whisper_log_mel(wav16k: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """(1, N) 16 kHz → (1, n_mels, N // 160): the speech tokenizer's input (whisper's log-mel)."""
    n_fft, hop = 400, 160
    spec = torch.stft(wav16k, n_fft, hop, window=torch.hann_window(n_fft, dtype=wav16k.dtype), return_complex=True)
    power = spec[..., :-1].abs() ** 2
    log_spec = (mel_filterbank(TOKENIZER_SAMPLE_RATE, n_fft, n_mels) @ power).clamp(min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def kaldi_fbank(wav16k: torch.Tensor, num_bins: int = 80) -> torch.Tensor:
    """(1, N) 16 kHz in [-1, 1] → (frames, num_bins) Kaldi log fbank, dither 0, Kaldi defaults otherwise."""
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.samp_freq = TOKENIZER_SAMPLE_RATE
    opts.mel_opts.num_bins = num_bins
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(TOKENIZER_SAMPLE_RATE, wav16k.reshape(-1).tolist())
    fbank.input_finished()
    if fbank.num_frames_ready == 0:
        return torch.zeros(0, num_bins)
    return torch.from_numpy(np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)]))


def campplus_input(wav16k: torch.Tensor) -> torch.Tensor:
    """Kaldi fbank with the per-bin mean removed: campplus's (T, 80) input."""
    feat = kaldi_fbank(wav16k)
    return feat - feat.mean(dim=0, keepdim=True)
