"""The official streaming vocoder (token2wav.py's modes "recompute" and "exact", spec §9)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from voicebot.tts.cosyvoice2.hift import DecodeJob, HiFT, SourceNoise, SourceRequest
from voicebot.tts.cosyvoice2.sampling import host_to_device


class ChunkVocoder:
    """The official streaming vocoder (modes "recompute" and "exact"): each chunk is one HiFT call
    over the previous chunk's last 8 mel frames and its own, with the previous chunk's source tail
    in place of the first 3840 samples of source; those samples are cross-faded (Hamming halves,
    float64) with the previous chunk's held-back tail, and a non-final chunk holds back its own."""

    def __init__(self, hift: HiFT, mel_cache_frames: int, zero_noise: bool,
                 generator: torch.Generator | None) -> None:
        self.hift, self.zero_noise, self.generator = hift, zero_noise, generator
        self.mel_cache_frames = mel_cache_frames  # 8
        self.overlap = mel_cache_frames * hift.samples_per_frame  # 3840 samples
        # float64, as the official blend; on the vocoder's device from the start (no copy per chunk)
        self.window = host_to_device(np.hamming(2 * self.overlap).tolist(), hift.conv_pre.bias.device, torch.float64)
        self.mel_cache: Tensor | None = None  # (1, 80, 8) last mel frames of the previous HiFT input
        self.source_cache: Tensor | None = None  # (1, 1, 3840) source tail of the previous chunk
        self.speech_tail: Tensor | None = None  # (1, 3840) held back for the cross-fade

    def prepare(self, mel: Tensor, final: bool) -> DecodeJob:
        """The chunk's decode, its source to be made by HiFT.excitations and handed to `sourced`."""
        if self.mel_cache is not None:
            mel = torch.cat([self.mel_cache, mel], dim=2)
        noise = None if self.zero_noise else SourceNoise.draw(
            mel.shape[2] * self.hift.samples_per_frame, self.hift.m_source.n_harmonics, self.generator, mel.device)
        self.mel_cache = mel[:, :, -self.mel_cache_frames :]
        return DecodeJob(mel, SourceRequest(mel, noise, head=self.source_cache), final)

    def sourced(self, job: DecodeJob, source: Tensor, cycles: Tensor) -> None:
        job.source = source
        self.source_cache = source[:, :, -self.overlap :]

    def complete(self, job: DecodeJob, speech: Tensor) -> Tensor:
        if self.speech_tail is not None:
            n, w = self.overlap, self.window
            head = speech[:, :n] * w[:n] + self.speech_tail * w[n:]  # float64, then back, like the official code
            speech = torch.cat([head.to(speech.dtype), speech[:, n:]], dim=1)
        if job.final:
            return speech
        self.speech_tail = speech[:, -self.overlap :]
        return speech[:, : -self.overlap]
