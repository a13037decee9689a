"""Mel → 24 kHz waveform: the HiFT vocoder (HiFTGenerator, spec §8).

    mel ─ f0 predictor ─ f0 ─ NSF sine source ─ STFT ─┐ (added at each resolution)
    mel ─ conv_pre ─ [lrelu ─ ConvTranspose ─ + source ─ mean of ResBlocks] ×3 ─ conv_post ─ iSTFT

Weight norm uses torch's parametrizations, so parameter names match hift.pt
(`<m>.parametrizations.weight.original0/1`). The source has random parts (initial harmonic phases
and additive noise); `SourceNoise` makes them explicit so tests can zero or inject them.
`HiFTStream` vocodes a mel that arrives in pieces with the same result as one call over all of it.

Vocoding is split in two, each run for several streams in one batch: `excitations` (f0 and source;
each utterance's phase and noise travel with its `SourceRequest`) and `decode_batch` (the decoder,
about 97 % of HiFT's work). Both take rows of any lengths, zero-padded to the longest and zeroed
past each row's end, so that each equals its own call alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm

from voicebot.tts.cosyvoice2.sampling import host_to_device


@dataclass
class SourceNoise:
    """The random draws of one source computation (L samples, H harmonics incl. the fundamental).

    rand_ini: (1, H) initial phases in cycles, U[0, 1); the fundamental's column is forced to 0.
    sine_noise: (1, L, H) standard normal, scaled by the voiced/unvoiced noise amplitude.
    """

    rand_ini: Tensor
    sine_noise: Tensor

    @classmethod
    def zeros(cls, n_samples: int, n_harmonics: int, device: torch.device | None = None) -> SourceNoise:
        return cls(torch.zeros(1, n_harmonics, device=device), torch.zeros(1, n_samples, n_harmonics, device=device))

    @classmethod
    def draw(
        cls, n_samples: int, n_harmonics: int, generator: torch.Generator | None = None,
        device: torch.device | None = None,
    ) -> SourceNoise:
        """Draw in the official order, including its third (discarded) draw, so that a seeded
        generator yields the same values as the official vocoder on the same generator."""
        rand_ini = torch.rand(1, n_harmonics, generator=generator, device=device)
        # The official noise is randn_like of a transposed view: torch fills such a non-contiguous
        # tensor with its element-wise sampler, whose values differ from a contiguous randn.
        sine_noise = torch.empty(1, n_harmonics, n_samples, device=device).transpose(1, 2).normal_(generator=generator)
        torch.empty(1, n_samples, 1, device=device).normal_(generator=generator)  # the official noise branch, unused
        return cls(rand_ini, sine_noise)


class SineSource(nn.Module):
    """NSF harmonic source ("SineGen2" + SourceModuleHnNSF): f0 (1, L, 1) at audio rate -> (1, L, 1).

    The phase is integrated at frame rate (down-interpolate the per-sample increment, cumsum,
    up-interpolate) rather than per sample, as the checkpoint was trained.
    """

    def __init__(self, sampling_rate: int, upsample_scale: int, harmonic_num: int, sine_amp: float,
                 noise_std: float, voiced_threshold: float) -> None:
        super().__init__()
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.n_harmonics = harmonic_num + 1
        self.sine_amp, self.noise_std, self.voiced_threshold = sine_amp, noise_std, voiced_threshold
        self.l_linear = nn.Linear(self.n_harmonics, 1)

    def forward(self, f0: Tensor, sine_noise: Tensor, rand_ini: Tensor, start_cycles: Tensor,
                edge: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """f0 (B, L, 1) at audio rate -> (source (B, L, 1), cycles (B, H, L/480) float64: the running
        phase, in cycles, through each frame), each row on its own.

        sine_noise (B, L, H): the per-sample noise draws; rand_ini (B, H): the initial phase (cycles)
        added at the first sample, zero for a row that continues a streamed utterance (and in the
        fundamental's column); start_cycles (B, H, 1) float64: the running phase before the first
        frame (zeros at an utterance's start). edge (B, 1, T): for rows padded past their own
        frames, each frame's index with the padding pointing at the row's last frame: the phase's
        up-interpolation reads one frame beyond, which alone is its last frame again (clamped).
        """
        harmonics = torch.arange(1, self.n_harmonics + 1, device=f0.device, dtype=f0.dtype)
        rad = (f0 * harmonics / self.sampling_rate) % 1  # (B, L, H) phase increment in cycles per sample
        rad[:, 0, :] += rand_ini
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / self.upsample_scale, mode="linear")  # (B, H, T)
        # A float32 cumsum accumulates in float64 on CPU and rounds each step; continuing a float64
        # running sum therefore gives a streamed utterance the same phases as one whole call.
        cycles = torch.cumsum(torch.cat([start_cycles, rad.double()], dim=2), dim=2)[:, :, 1:]
        edged = cycles if edge is None else cycles.gather(2, edge.expand(-1, cycles.shape[1], -1))
        phase = edged.to(f0.dtype) * 2 * math.pi
        phase = F.interpolate(phase * self.upsample_scale, scale_factor=self.upsample_scale, mode="linear")
        sines = torch.sin(phase).transpose(1, 2) * self.sine_amp  # (B, L, H)
        uv = (f0 > self.voiced_threshold).to(f0.dtype)  # (B, L, 1)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        sines = sines * uv + noise_amp * sine_noise
        return torch.tanh(self.l_linear(sines)), cycles


class F0Predictor(nn.Module):
    """ConvRNNF0Predictor: 5 × (weight-normed conv k=3 → ELU), then a linear head; |·| gives Hz."""

    def __init__(self, in_channels: int, cond_channels: int, num_class: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            conv = nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1)
            layers += [weight_norm(conv), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: Tensor, own: Tensor | None = None) -> Tensor:  # (B, 80, T) -> (B, T)
        """own (B, 1, T): 1 on each row's own frames, 0 on its padding, which every convolution
        then reads as zeros, as its own zero padding alone (None: no row is padded)."""
        x = mel
        for layer in self.condnet:
            x = layer(x if own is None or not isinstance(layer, nn.Conv1d) else x * own)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))


class Snake(nn.Module):
    """x + sin²(αx)/α with a per-channel α (linear scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:  # (B, C, T)
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Per dilation d: x += conv2(snake(conv1_d(snake(x)))), 'same' padding throughout."""

    def __init__(self, channels: int, kernel_size: int, dilations: list[int]) -> None:
        super().__init__()

        def conv(d: int) -> nn.Module:
            same = d * (kernel_size - 1) // 2
            return weight_norm(nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=same))

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor, own: Tensor | None = None) -> Tensor:
        """own (B, 1, T): 1 on each row's own samples, 0 past its end, where its convolutions must
        read zeros, as their own zero padding alone (None: no row is padded)."""
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + c2(_masked(a2(c1(_masked(a1(x), own))), own))
        return x


def _masked(x: Tensor, own: Tensor | None) -> Tensor:
    """x (B, C, T) zeroed past each row's end (`own`, (B, 1, T)); x itself when nothing is padded."""
    return x if own is None else x * own


def _own(lengths: Tensor, size: int, dtype: torch.dtype) -> Tensor:
    """(B, 1, size): 1 where a position is before its row's length (B,), else 0."""
    return (torch.arange(size, device=lengths.device) < lengths[:, None]).to(dtype)[:, None]


class HiFT(nn.Module):
    def __init__(
        self,
        in_channels: int,
        base_channels: int,
        nb_harmonics: int,
        sampling_rate: int,
        nsf_alpha: float,
        nsf_sigma: float,
        nsf_voiced_threshold: float,
        upsample_rates: list[int],
        upsample_kernel_sizes: list[int],
        n_fft: int,
        hop_len: int,
        resblock_kernel_sizes: list[int],
        resblock_dilation_sizes: list[list[int]],
        source_resblock_kernel_sizes: list[int],
        source_resblock_dilation_sizes: list[list[int]],
        lrelu_slope: float,
        audio_limit: float,
        f0_cond_channels: int,
        f0_num_class: int = 1,
    ) -> None:
        super().__init__()
        self.n_fft, self.hop_len = n_fft, hop_len
        self.lrelu_slope, self.audio_limit = lrelu_slope, audio_limit
        self.samples_per_frame = int(np.prod(upsample_rates)) * hop_len  # 480 at 24 kHz
        self.m_source = SineSource(
            sampling_rate, self.samples_per_frame, nb_harmonics, nsf_alpha, nsf_sigma, nsf_voiced_threshold
        )
        n_stages = len(upsample_rates)
        width = [base_channels // 2**i for i in range(n_stages + 1)]  # channels before/after each stage
        self.conv_pre = weight_norm(nn.Conv1d(in_channels, width[0], 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(width[i], width[i + 1], k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(upsample_rates, upsample_kernel_sizes))
        )
        # The source's STFT frames (hop_len samples) are brought to each stage's rate: the last
        # stage runs at the STFT rate, earlier ones at cumulative products of the later rates.
        down_rates = [int(r) for r in np.cumprod([1] + upsample_rates[::-1][:-1])[::-1]]
        spec_channels = n_fft + 2
        self.source_downs = nn.ModuleList(
            nn.Conv1d(spec_channels, width[i + 1], 1) if u == 1
            else nn.Conv1d(spec_channels, width[i + 1], u * 2, u, padding=u // 2)
            for i, u in enumerate(down_rates)
        )
        self.source_resblocks = nn.ModuleList(
            ResBlock(width[i + 1], k, d)
            for i, (k, d) in enumerate(zip(source_resblock_kernel_sizes, source_resblock_dilation_sizes))
        )
        self.num_kernels = len(resblock_kernel_sizes)
        self.resblocks = nn.ModuleList(
            ResBlock(width[i + 1], k, d)
            for i in range(n_stages)
            for k, d in zip(resblock_kernel_sizes, resblock_dilation_sizes)
        )
        self.conv_post = weight_norm(nn.Conv1d(width[-1], spec_channels, 7, padding=3))
        self.f0_predictor = F0Predictor(in_channels, f0_cond_channels, f0_num_class)
        # scipy's periodic Hann; not in the state dict (a plain attribute in the official class), a
        # buffer here so that it moves with the module instead of being copied from the host per call;
        # made on the CPU even when the module is built on the meta device (the loader's), as it has no key
        self.register_buffer("stft_window", torch.hann_window(n_fft, periodic=True, dtype=torch.float64, device="cpu").float(),
                             persistent=False)

    def _stft(self, source: Tensor, length: Tensor) -> Tensor:
        """source (B, L), row b's own its first length[b] samples -> its STFT frames (B, n_fft+2,
        L/hop + 1) [real | imag]: each row reflect-padded at its own ends, as torch.stft's centring
        pads it alone (one gather over all rows), its frames past its own length/hop + 1 zero."""
        pad = self.n_fft // 2
        length = length[:, None]  # (B, 1)
        j = torch.arange(source.shape[1] + 2 * pad, device=source.device)[None]
        at = (j - pad).abs()  # reflected at the start
        at = torch.where(at >= length, 2 * (length - 1) - at, at).clamp(0, source.shape[1] - 1)  # and at the end
        padded = source.gather(1, at.expand(source.shape[0], -1)) * (j < length + 2 * pad)  # zero past a row's own
        spec = torch.stft(padded, self.n_fft, self.hop_len, self.n_fft, window=self.stft_window, center=False,
                          return_complex=True)
        own = torch.arange(spec.shape[2], device=source.device)[None] < length // self.hop_len + 1
        return torch.cat([spec.real, spec.imag], dim=1) * own[:, None]

    def _istft(self, x: Tensor, n_frames: Tensor) -> Tensor:
        """conv_post's output x (B, n_fft+2, F) [log-magnitude | phase], row b's own frames its first
        n_frames[b] -> audio (B, hop·(F-1)), row b's first hop·(n_frames[b]-1) samples as torch.istft
        of its own frames alone: one inverse FFT and one overlap-add for all rows, each row divided
        by the window envelope of its own frames."""
        half, pad, hop = self.n_fft // 2 + 1, self.n_fft // 2, self.hop_len
        rows, _, n = x.shape
        own = _own(n_frames, n, x.dtype)
        magnitude = torch.clip(torch.exp(x[:, :half]), max=1e2) * own
        phase = torch.sin(x[:, half:])  # the phase channels go through sin, as in the trained model
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        frames = torch.fft.irfft(spec, n=self.n_fft, dim=1) * self.stft_window[:, None]
        length = (n - 1) * hop + self.n_fft
        fold = dict(output_size=(1, length), kernel_size=(1, self.n_fft), stride=(1, hop))
        audio = F.fold(frames, **fold).reshape(rows, length)
        envelope = F.fold((self.stft_window**2)[None, :, None] * own, **fold).reshape(rows, length)
        return (audio / envelope.clamp_min(1e-11))[:, pad : pad + hop * (n - 1)]

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """mel (1, 80, T), source (1, 1, 480T) -> waveform (1, 480T)."""
        return self.decode_batch([mel], [source])[0]

    def decode_batch(self, mels: list[Tensor], sources: list[Tensor]) -> list[Tensor]:
        """`decode` of several (mel, source) pairs of any lengths in one batch, padded to the
        longest; each result equals its own call. (Token2Wav pads to a bucket instead, whose shapes
        a CUDA graph keeps: `padded_batch`, `decode_padded`.)"""
        lengths = [m.shape[2] for m in mels]
        # one pair at its own length fills its batch: nothing to mask
        audio = self.decode_padded(*self.padded_batch(mels, sources), masked=len(mels) > 1)
        return [audio[b : b + 1, : n * self.samples_per_frame] for b, n in enumerate(lengths)]

    def padded_batch(self, mels: list[Tensor], sources: list[Tensor],
                     shape: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """decode_padded's inputs for the pairs: mel (B, 80, T) and source (B, 480T) zero-padded,
        frames (B,) each row's own (1 for a padding row: one zero frame)."""
        lengths = [m.shape[2] for m in mels]
        rows, longest = shape or (len(mels), max(lengths))
        if rows < len(mels) or longest < max(lengths):
            raise ValueError(f"{len(mels)} mels of up to {max(lengths)} frames in a batch of {rows} × {longest}")
        spf, empty = self.samples_per_frame, rows - len(mels)
        mel = torch.cat([F.pad(m, (0, longest - m.shape[2])) for m in mels]
                        + ([mels[0].new_zeros(empty, mels[0].shape[1], longest)] if empty else []))
        source = torch.cat([F.pad(s.reshape(1, -1), (0, longest * spf - s.shape[2])) for s in sources]
                           + ([sources[0].new_zeros(empty, longest * spf)] if empty else []))
        return mel, source, host_to_device(lengths + [1] * empty, mel.device)

    def decode_padded(self, mel: Tensor, source: Tensor, frames: Tensor, masked: bool = True) -> Tensor:
        """The decoder over a padded batch: mel (B, 80, T), source (B, 480T), frames (B,) each row's
        own -> audio (B, 480T), each row's first 480·frames samples as its own call alone.

        Every convolution's input is zeroed past a row's end, which is what the convolution's own
        zero padding gives it alone; the STFT and iSTFT run batched, each row padded and
        window-normalised at its own ends as alone. Shapes depend on (B, T) only, and nothing is
        read back to the host: a CUDA graph captures it per bucket (token2wav.py). masked=False:
        every row fills the batch (no padding), so nothing is zeroed."""
        s = self._stft(source, frames * self.samples_per_frame)  # (B, n_fft+2, n_stft)
        rate = 1
        x = self.conv_pre(mel)
        for i, up in enumerate(self.ups):
            own = _own(frames * rate, x.shape[2], x.dtype) if masked else None
            x = up(_masked(F.leaky_relu(x, self.lrelu_slope), own))
            rate *= up.stride[0]
            extra = 0
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one more frame to line up with the STFT frames
                extra = 1
            own = _own(frames * rate + extra, x.shape[2], x.dtype) if masked else None
            x = x + self.source_resblocks[i](self.source_downs[i](s), own)
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            x = sum(block(x, own) for block in blocks) / self.num_kernels
        x = self.conv_post(_masked(F.leaky_relu(x), own))  # default slope 0.01 here
        return torch.clamp(self._istft(x, frames * rate + 1), -self.audio_limit, self.audio_limit)

    def excitation(
        self, mel: Tensor, cache_source: Tensor | None = None, noise: SourceNoise | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """The source (1, 1, 480T) `inference` gives `decode` for mel (1, 80, T); see there."""
        if noise is None:
            noise = SourceNoise.draw(mel.shape[2] * self.samples_per_frame, self.m_source.n_harmonics, generator,
                                     mel.device)
        return self.excitations([SourceRequest(mel, noise, head=cache_source)])[0][0]

    def source(self, f0: Tensor, noise: SourceNoise, start_cycles: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """f0 (1, T) in Hz -> (NSF source (1, 1, 480T), running phase (1, H, T), see SineSource)."""
        return self._sources(f0, [noise], [start_cycles], [f0.shape[1]])

    def excitations(self, requests: list[SourceRequest]) -> list[tuple[Tensor, Tensor]]:
        """Each request's (source (1, 1, 480T), running phase (1, H, T) float64), all of them in one
        batch: the f0 predictor over their mels zero-padded to the longest (each convolution's input
        zeroed past a row's end), the source over their frames padded to the most. Each equals its
        request alone (the same operations, row by row)."""
        device = requests[0].f0_mel.device
        f0_lengths = [r.f0_mel.shape[2] for r in requests]
        frames = [n - r.f0_from for n, r in zip(f0_lengths, requests)]
        longest, most = max(f0_lengths), max(frames)
        if len(requests) == 1:
            f0 = self.f0_predictor(requests[0].f0_mel)[:, requests[0].f0_from :]
        else:
            mel = torch.cat([F.pad(r.f0_mel, (0, longest - n)) for r, n in zip(requests, f0_lengths)])
            own = torch.arange(longest, device=device) < host_to_device(f0_lengths, device)[:, None]
            f0 = self.f0_predictor(mel, own[:, None].to(mel.dtype))
            # each row's frames from its f0_from on (past its own: its last, which the source cuts off)
            take = host_to_device([[r.f0_from + min(t, n - 1) for t in range(most)]
                                   for r, n in zip(requests, frames)], device)
            f0 = f0.gather(1, take)  # (B, most)
        source, cycles = self._sources(f0, [r.noise for r in requests], [r.start_cycles for r in requests], frames)
        for b, r in enumerate(requests):
            if r.head is not None and r.head.shape[2] > 0:
                source[b, :, : r.head.shape[2]] = r.head[0]
        spf = self.samples_per_frame
        return [(source[b : b + 1, :, : n * spf], cycles[b : b + 1, :, :n]) for b, n in enumerate(frames)]

    def _sources(self, f0: Tensor, noises: list[SourceNoise | None], start_cycles: list[Tensor | None],
                 frames: list[int]) -> tuple[Tensor, Tensor]:
        """f0 (B, T) in Hz, row b's own its first frames[b] -> (source (B, 1, 480T), phase (B, H, T)).
        A row's noise None: zero noise; its start_cycles None: the utterance's start (its rand_ini
        then sets the initial phases)."""
        spf, h, device = self.samples_per_frame, self.m_source.n_harmonics, f0.device
        n_samples = f0.shape[1] * spf
        f0 = F.interpolate(f0[:, None], scale_factor=float(spf), mode="nearest")  # (B, 1, L)
        zeros = f0.new_zeros(1, n_samples, h)
        sine_noise = torch.cat([zeros if n is None else F.pad(n.sine_noise, (0, 0, 0, n_samples - n.sine_noise.shape[1]))
                                for n in noises])
        rand_ini = torch.cat([n.rand_ini if n is not None and c is None else zeros[:, 0]
                              for n, c in zip(noises, start_cycles)])
        rand_ini[:, 0] = 0  # the fundamental starts at phase 0
        start = torch.cat([f0.new_zeros(1, h, 1, dtype=torch.float64) if c is None else c for c in start_cycles])
        edge = None
        if min(frames) < f0.shape[2] // spf:
            edge = host_to_device([[min(t, n - 1) for t in range(f0.shape[2] // spf)] for n in frames], device)[:, None]
        source, cycles = self.m_source(f0.transpose(1, 2), sine_noise, rand_ini, start, edge)
        return source.transpose(1, 2), cycles

    def context_frames(self) -> tuple[int, int]:
        """(decode, f0): mel frames on either side of an output sample that it depends on.

        decode covers conv_pre, the up-sampling stages with their ResBlocks, conv_post and the
        iSTFT, and also the source branch (STFT, source_downs, source ResBlocks) plus the one frame
        the source's phase interpolation reaches; f0 is what the f0 predictor adds to that for mel
        frames, since the source depends on the mel only through f0. Computed from the layer
        shapes, in audio samples, rounded up to whole frames.
        """
        def resblock_reach(block: ResBlock) -> int:  # in samples of its own rate
            return sum(c1.dilation[0] * (c1.kernel_size[0] // 2) + c2.kernel_size[0] // 2
                       for c1, c2 in zip(block.convs1, block.convs2))

        stft_reach = self.n_fft // 2  # an STFT frame's window, either side of its centre
        spacing = self.hop_len  # audio samples between two samples of the current stage
        reach = stft_reach + self.conv_post.kernel_size[0] // 2 * spacing
        source_reach = 0
        for i in reversed(range(len(self.ups))):
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            reach += max(resblock_reach(b) for b in blocks) * spacing
            down = self.source_downs[i]  # over STFT frames; its kernel spans it either side
            source_reach = max(source_reach, reach + resblock_reach(self.source_resblocks[i]) * spacing
                               + down.kernel_size[0] * self.hop_len + stft_reach)
            up = self.ups[i]
            reach += math.ceil((up.kernel_size[0] + up.stride[0]) / 2) * spacing
            spacing *= up.stride[0]
        reach += self.conv_pre.kernel_size[0] // 2 * spacing
        source_reach += self.samples_per_frame  # phase interpolation between frame centres
        f0_reach = sum(m.kernel_size[0] // 2 for m in self.f0_predictor.condnet if isinstance(m, nn.Conv1d))
        return math.ceil(max(reach, source_reach) / self.samples_per_frame), f0_reach

    @torch.inference_mode()
    def inference(
        self,
        mel: Tensor,
        cache_source: Tensor | None = None,
        noise: SourceNoise | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """mel (1, 80, T) -> (waveform (1, 480T), source (1, 1, 480T)).

        cache_source (1, 1, C): the previous chunk's source tail, which replaces the first C
        samples so that overlapping frames are voiced with the same excitation.
        noise: the source's random draws; drawn from `generator` (default: torch's global one) if None.
        """
        source = self.excitation(mel, cache_source, noise, generator)
        return self.decode(mel, source), source


@dataclass
class SourceRequest:
    """One piece of an utterance for `HiFT.excitations`: the f0 predictor runs over `f0_mel`
    (1, 80, T_f) and the source over its f0 from frame `f0_from` on (T = T_f − f0_from frames,
    480T samples), with `noise`'s draws for those samples (None: zero noise), continuing the running
    phase `start_cycles` (1, H, 1) float64 (None: the utterance's first sample, which gets
    noise.rand_ini); `head` (1, 1, C): samples that replace the source's first C (the previous
    chunk's source tail, in the official chunk vocoder)."""

    f0_mel: Tensor
    noise: SourceNoise | None
    f0_from: int = 0
    start_cycles: Tensor | None = None
    head: Tensor | None = None


@dataclass
class DecodeJob:
    """A streaming vocoder's pending decode: `mel` (1, 80, T) with its source (1, 1, 480T), which
    `HiFT.excitations` makes from `source_request` and the vocoder's `sourced` sets; `final`: the
    utterance's last; `keep`: the samples of the decoded window that become its audio;
    `phase_at`: the frame whose running phase the vocoder keeps for its next piece (None: none)."""

    mel: Tensor
    source_request: SourceRequest
    final: bool
    keep: slice = field(default_factory=lambda: slice(None))
    phase_at: int | None = None
    source: Tensor | None = None


class HiFTStream:
    """One utterance's mel, vocoded piece by piece so that the audio equals one `HiFT.inference`
    over the whole mel (with zero source noise: to float rounding).

    HiFT's convolutions are centred, so a sample needs `context` mel frames on both sides (see
    `HiFT.context_frames`). Each `push` runs HiFT on [context | unvoiced | lookahead] frames and
    keeps only the unvoiced samples whose context is complete: the last `lookahead` frames wait for
    the next push (or `final`), which is the latency this costs (20 ms a frame). The f0 predictor
    gets `f0_context` more frames on the left so that the source is exact across the whole decode
    window. The sine phase is a running sum over all earlier frames, so it is carried across pushes
    instead of being recomputed or cached as audio. Source noise, when on, is drawn once per sample
    and kept for the frames voiced again as context.
    """

    def __init__(self, hift: HiFT, zero_noise: bool = False, generator: torch.Generator | None = None) -> None:
        self.hift, self.zero_noise, self.generator = hift, zero_noise, generator
        self.context, self.f0_context = hift.context_frames()
        self.lookahead = self.context + self.f0_context  # the source reaches the mel through f0
        self.n_harmonics = hift.m_source.n_harmonics
        self.n_frames = 0  # mel frames pushed
        self.voiced = 0  # frames whose audio has been returned
        self.mel: Tensor | None = None  # frames from `mel_start` on: the next push's left context
        self.mel_start = 0
        self.start_cycles: Tensor | None = None  # running phase before the next window; None at frame 0
        self.rand_ini: Tensor | None = None
        self.sine_noise: Tensor | None = None  # (1, n, H) from the next window's first sample on

    def _noise(self, start: int, end: int, device: torch.device) -> SourceNoise | None:
        """The source noise of frames [start, end), drawing the samples not drawn before (None: off)."""
        spf, h = self.hift.samples_per_frame, self.n_harmonics
        if self.zero_noise:
            return None
        if self.rand_ini is None:
            self.rand_ini = torch.rand(1, h, generator=self.generator, device=device)
            self.sine_noise = torch.zeros(1, 0, h, device=device)
        missing = (end - start) * spf - self.sine_noise.shape[1]
        new = torch.randn(1, missing, h, generator=self.generator, device=device)
        self.sine_noise = torch.cat([self.sine_noise, new], dim=1)
        return SourceNoise(self.rand_ini, self.sine_noise)

    @torch.inference_mode()
    def push(self, mel: Tensor, final: bool = False) -> Tensor:
        """Add the next mel frames (1, 80, n); returns the audio (1, 480k) that is now final, all
        of the rest when `final`."""
        job = self.prepare(mel, final)
        if job is None:
            return mel.new_zeros(1, 0)
        self.sourced(job, *self.hift.excitations([job.source_request])[0])
        return self.complete(job, self.hift.decode(job.mel, job.source))

    def prepare(self, mel: Tensor, final: bool = False) -> DecodeJob | None:
        """`push` up to the source and the decode, which the caller runs (with other streams' in
        `HiFT.excitations` and `decode_batch`), handing the source to `sourced` and the audio to
        `complete`; the stream's state has moved on but for its phase (`sourced`). None: nothing to voice."""
        self.mel = mel if self.mel is None else torch.cat([self.mel, mel], dim=2)
        self.n_frames += mel.shape[2]
        done = self.n_frames if final else max(self.voiced, self.n_frames - self.lookahead)
        if done == self.voiced:
            return None
        start = max(0, self.voiced - self.context)  # the decode window is [start, n_frames)
        window = self.mel[:, :, start - self.mel_start :]
        request = SourceRequest(self.mel, self._noise(start, self.n_frames, mel.device), start - self.mel_start,
                                self.start_cycles)
        spf = self.hift.samples_per_frame
        # Move the state to the next window; its f0 there is exact (well inside this window).
        next_start = max(0, done - self.context)
        job = DecodeJob(window, request, final, keep=slice((self.voiced - start) * spf, (done - start) * spf),
                        phase_at=next_start - start - 1 if next_start > start else None)
        if next_start > start and self.sine_noise is not None:
            self.sine_noise = self.sine_noise[:, (next_start - start) * spf :]
        keep_from = max(0, next_start - self.f0_context)
        self.mel = self.mel[:, :, keep_from - self.mel_start :]
        self.mel_start, self.voiced = keep_from, done
        return job

    def sourced(self, job: DecodeJob, source: Tensor, cycles: Tensor) -> None:
        """The prepared job's source and running phase (HiFT.excitations): keep the phase the next
        window starts from."""
        job.source = source
        if job.phase_at is not None:
            self.start_cycles = cycles[:, :, job.phase_at : job.phase_at + 1]

    def complete(self, job: DecodeJob, wav: Tensor) -> Tensor:
        """The audio of a prepared push, from its decoded window (1, 480·frames)."""
        return wav[:, job.keep]


def build_hift(hp: dict[str, Any]) -> HiFT:
    """Build from the `hift` section of cosyvoice2.yaml (as read by hparams.load_hparams)."""
    f0 = hp["f0_predictor"]
    return HiFT(
        in_channels=hp["in_channels"],
        base_channels=hp["base_channels"],
        nb_harmonics=hp["nb_harmonics"],
        sampling_rate=hp["sampling_rate"],
        nsf_alpha=hp["nsf_alpha"],
        nsf_sigma=hp["nsf_sigma"],
        nsf_voiced_threshold=hp["nsf_voiced_threshold"],
        upsample_rates=list(hp["upsample_rates"]),
        upsample_kernel_sizes=list(hp["upsample_kernel_sizes"]),
        n_fft=hp["istft_params"]["n_fft"],
        hop_len=hp["istft_params"]["hop_len"],
        resblock_kernel_sizes=list(hp["resblock_kernel_sizes"]),
        resblock_dilation_sizes=[list(d) for d in hp["resblock_dilation_sizes"]],
        source_resblock_kernel_sizes=list(hp["source_resblock_kernel_sizes"]),
        source_resblock_dilation_sizes=[list(d) for d in hp["source_resblock_dilation_sizes"]],
        lrelu_slope=hp["lrelu_slope"],
        audio_limit=hp["audio_limit"],
        f0_cond_channels=f0["cond_channels"],
        f0_num_class=f0.get("num_class", 1),
    )
