"""HiFT's decode at bucketed static shapes, so that CUDA graphs capture it (issue 24).

A decode of B mel windows of up to T frames runs at its bucket (B', T'): B' the smallest of the
stream buckets ≥ B, T' the smallest multiple of DECODE_FRAME_STEP ≥ T, up to the longest window a
render decodes (its longest chunk and HiFT's context: `longest`). Padded rows and frames are inert
(HiFT.decode_padded zeroes every convolution's input past a row's end). On CUDA each bucket is one
graph, captured at start-up (graphs.py); elsewhere the padded shapes run eagerly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from voicebot.tts.cosyvoice2.graphs import BucketGraphs, bucket_of
from voicebot.tts.cosyvoice2.hift import HiFT

DECODE_FRAME_STEP = 32  # mel frames (0.64 s): the windows' bucket step


class HiFTBuckets:
    def __init__(self, hift: HiFT, stream_buckets: tuple[int, ...], longest: int, pool: tuple | None = None) -> None:
        self.hift = hift
        step = DECODE_FRAME_STEP
        self.buckets = [(s, t) for s in stream_buckets for t in range(step, math.ceil(longest / step) * step + 1, step)]
        self.graphs = BucketGraphs(lambda *padded: (hift.decode_padded(*padded),), self._zeros, pool)

    def capture(self) -> int:
        """Capture every bucket's graph (CUDA): at start-up, never mid-traffic. Returns how many."""
        for bucket in self.buckets:
            self.graphs.capture(bucket)
        return len(self.buckets)

    def decode(self, mels: list[Tensor], sources: list[Tensor]) -> list[Tensor]:
        """HiFT.decode_batch at the pairs' bucket: each result (1, 480·T_b) equals its own call."""
        bucket = (bucket_of(len(mels), {s for s, _ in self.buckets}),
                  bucket_of(max(m.shape[2] for m in mels), {t for _, t in self.buckets}))
        audio, = self.graphs.run(bucket, self.hift.padded_batch(mels, sources, bucket))
        audio = audio[: len(mels)].clone()  # the graph's output is overwritten by its next replay
        return [audio[b : b + 1, : m.shape[2] * self.hift.samples_per_frame] for b, m in enumerate(mels)]

    def _zeros(self, bucket: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
        rows, frames = bucket
        like = self.hift.conv_pre.bias
        return (like.new_zeros(rows, self.hift.conv_pre.in_channels, frames),
                like.new_zeros(rows, frames * self.hift.samples_per_frame),
                torch.ones(rows, dtype=torch.long, device=like.device))
