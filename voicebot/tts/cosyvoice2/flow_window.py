"""The streaming flow at bucketed static shapes, so that CUDA graphs capture it (issue 24).

The eager flow (flow.py, estimator.py `PackedCall`) shapes each call by its requests: the number of
streams, each one's new frames, each one's cached frames. Here a call of S streams of up to Q new
frames each runs at its bucket (S', Q'): S' the smallest of `stream_buckets` ≥ S, Q' the smallest
multiple of the 50-frame chunk ≥ Q, up to `max_frames`. Padded streams and frames are inert
(estimator.py `WindowCall`: masked keys, padded queries see only themselves, nothing of theirs is
read back). A stream's cache must be bounded: its window of W = left_chunks × 50 frames (the
official `num_decoding_left_chunks`) lives in a `WindowState` whose keys and values are laid out
as a bucketed call reads them, right-aligned in W frames, so a call takes S' states with one stack
each for keys, values and conv contexts, and hands back each stream's next state as a view of
the call's output.

Around the graph, a call's streams share their launches as well: one encoder pass over all their
tokens (Flow.encode_streaming, rows padded and masked), one gather each for the bucket's mu and
cond, one stack each for the states.

The whole Euler schedule of a bucket (10 estimator calls, CFG, the update) is one function of
tensors whose shapes depend on (S', Q') alone, with nothing read back to the host: on CUDA it is
captured as one graph per bucket at start-up (`capture`) and replayed per render (graphs.py);
elsewhere it runs eagerly at the same padded shapes (what the tests compare against the eager flow).

The bucket set, written down: S' in `stream_buckets` (powers of two up to the render batch), Q' in
50, 100, …, `max_frames` rounded up to 50 (a render's chunk is at most max_hop + lookahead
tokens, 2 frames each: 206 frames, Q' ≤ 250, 5 sizes): 4 × 5 = 20 graphs for a render batch of 8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from voicebot.tts.cosyvoice2.estimator import Attention, CausalConv1d, EstimatorCache, WindowCall
from voicebot.tts.cosyvoice2.flow import Flow, FlowCache
from voicebot.tts.cosyvoice2.graphs import BucketGraphs, bucket_of
from voicebot.tts.cosyvoice2.sampling import host_to_device


@dataclass
class WindowState:
    """A stream's flow state in a bucketed call's layout: keys/values (steps, n_attn, 2, H, W, d) of
    the window's frames right-aligned, the last `held` valid; conv (steps, 2, lp, ΣC) every causal
    conv's last lp input frames; n_frames: the frames computed so far (the next call's start)."""

    keys: Tensor
    values: Tensor
    conv: Tensor
    held: int
    n_frames: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.conv))

    def fork(self) -> WindowState:
        """A stream's state continuing this one (a voice's prompt state): the same tensors, which a
        call only reads (it hands the stream views of its own output)."""
        return WindowState(self.keys, self.values, self.conv, self.held, self.n_frames)


@dataclass
class WindowRequest:
    """One stream's chunk: prompt+target `tokens` (1, N) (the flow's own inputs, as FlowRequest),
    its voice's `prompt_feat` (1, 2P, 80) and `embedding` (1, 192); `finalize`: its last chunk."""

    tokens: Tensor
    prompt_feat: Tensor
    embedding: Tensor
    finalize: bool
    state: WindowState


class WindowFlow:
    def __init__(self, flow: Flow, left_chunks: int, stream_buckets: tuple[int, ...], max_frames: int,
                 pool: tuple | None = None) -> None:
        estimator = flow.decoder.estimator
        if left_chunks < 0:
            raise ValueError("bucketed shapes need a bounded flow window (flow_left_chunks >= 0)")
        pads = {m.left_pad for m in estimator.modules() if isinstance(m, CausalConv1d)}
        if len(pads) != 1:
            raise ValueError(f"the estimator's causal convs differ in context ({pads}): one layout holds one")
        self.flow, self.estimator = flow, estimator
        self.chunk = estimator.static_chunk_size
        self.left_chunks, self.window, self.left_pad = left_chunks, left_chunks * self.chunk, pads.pop()
        self.stream_buckets = tuple(sorted(stream_buckets))
        self.frame_buckets = tuple(range(self.chunk, math.ceil(max_frames / self.chunk) * self.chunk + 1, self.chunk))
        convs = sorted((m for m in estimator.modules() if isinstance(m, CausalConv1d)), key=lambda m: m.cache_slot)
        self.conv_at = [sum(c.in_channels for c in convs[:i]) for i in range(len(convs))]
        self.conv_channels = sum(c.in_channels for c in convs)
        attn = next(m for m in estimator.modules() if isinstance(m, Attention))
        self.n_attn = sum(isinstance(m, Attention) for m in estimator.modules())
        self.heads, self.head_dim = attn.heads, attn.head_dim
        self.graphs = BucketGraphs(self._solve, self._static, pool)
        self._buffers: tuple[Tensor, Tensor, Tensor] | None = None  # the states' static inputs, shared by buckets

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return [(s, q) for s in self.stream_buckets for q in self.frame_buckets]

    def bucket(self, streams: int, frames: int) -> tuple[int, int]:
        return bucket_of(streams, self.stream_buckets), bucket_of(frames, self.frame_buckets)

    def _like(self) -> Tensor:
        return self.flow.encoder_proj.weight

    def _empty_state(self, streams: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Zero keys, values and conv contexts of one stream's state, or of `streams` side by side."""
        w = self._like()
        steps, lead = self.flow.n_timesteps, () if streams is None else (streams,)
        kv = (steps, self.n_attn, *lead, 2, self.heads, self.window, self.head_dim)
        return (w.new_zeros(kv), w.new_zeros(kv), w.new_zeros(steps, *lead, 2, self.left_pad, self.conv_channels))

    def state(self, base: FlowCache) -> WindowState:
        """A new stream's state continuing a voice's prompt state (flow.prompt_cache, windowed)."""
        if base.left_chunks != self.left_chunks:
            raise ValueError(f"a prompt state of window {base.left_chunks}, the flow's is {self.left_chunks}")
        keys, values, conv = self._empty_state()
        first: EstimatorCache = base.steps[0]
        held = base.n_frames - first.own_start
        for s, step in enumerate(base.steps):
            for slot in range(self.n_attn):
                if held:
                    keys[s, slot, :, :, self.window - held :] = step.keys[slot]
                    values[s, slot, :, :, self.window - held :] = step.values[slot]
            for i, context in enumerate(step.conv):
                if context is not None:
                    conv[s, :, :, self.conv_at[i] : self.conv_at[i] + context.shape[-1]] = context
        return WindowState(keys, values, conv, held, base.n_frames)

    def render(self, requests: list[WindowRequest]) -> list[Tensor]:
        """Each request's new mel (1, 80, n) float32 (the prompt's own frames left out), all of them
        in one call at their bucket; each request's state moves on past its frames."""
        flow, device = self.flow, self._like().device
        dtype = self._like().dtype
        mu_all, ends = flow.encode_streaming([r.tokens for r in requests], [r.finalize for r in requests])
        n_new = [end - r.state.n_frames for end, r in zip(ends, requests)]
        for r, end in zip(requests, ends):
            if not r.finalize and end % self.chunk:
                raise ValueError(f"a non-final chunk must end on a chunk boundary ({end} frames)")
        streams, frames = self.bucket(len(requests), max(n_new))
        empty = streams - len(requests)
        # every stream's rows of the bucket, gathered with one host-made index each: mu from its
        # encoder row, cond from its voice's prompt mel (zero past it); padding repeats a frame
        width, prompt_at, take, take_cond = mu_all.shape[1], 0, [], []
        for b, (r, n) in enumerate(zip(requests, n_new)):
            start, n_prompt = r.state.n_frames, r.prompt_feat.shape[1]
            for q in range(frames):
                f = start + min(q, n - 1)
                take.append(b * width + f)
                take_cond.append(prompt_at + f if f < n_prompt else -1)
            prompt_at += n_prompt
        take += [0] * (empty * frames)
        take_cond = [prompt_at if i < 0 else i for i in take_cond] + [prompt_at] * (empty * frames)
        take, take_cond = host_to_device([take, take_cond], device)
        mu = mu_all.reshape(-1, mu_all.shape[2])[take].view(streams, frames, -1)
        prompts = torch.cat([r.prompt_feat[0].to(dtype) for r in requests] + [mu.new_zeros(1, mu.shape[2])])
        cond = prompts[take_cond].view(streams, frames, -1)
        embeddings = torch.cat([r.embedding.to(dtype) for r in requests])
        spks = F.pad(flow.spk_embed_affine_layer(F.normalize(embeddings, dim=1)), (0, 0, 0, empty))
        at = host_to_device([[r.state.n_frames for r in requests] + [0] * empty,
                             [r.state.held for r in requests] + [0] * empty, n_new + [0] * empty], device)
        blank = self._empty_state() if empty else ()  # a padding stream's state: zeros
        keys, values, conv = (torch.stack([getattr(r.state, name) for r in requests] + [b] * empty, dim=dim)
                              for name, dim, b in zip(("keys", "values", "conv"), (2, 2, 1), blank or (None,) * 3))
        mel, keys, values, conv = self.graphs.run((streams, frames), (mu, spks, cond, at, keys, values, conv))
        # the streams' own rows, copied out of the graph's outputs (one copy each, padding left behind)
        n = len(requests)
        mel, keys, values, conv = mel[:n].clone(), keys[:, :, :n].clone(), values[:, :, :n].clone(), conv[:, :n].clone()
        mels = []
        for s, (r, n) in enumerate(zip(requests, n_new)):
            start = r.state.n_frames
            skip = max(0, r.prompt_feat.shape[1] - start)  # the prompt's own frames are not returned
            mels.append(mel[s, skip:n].t()[None])
            # views of the call's copies: freed once every stream of the call has rendered again
            r.state.keys, r.state.values, r.state.conv = keys[:, :, s], values[:, :, s], conv[:, s]
            r.state.held, r.state.n_frames = min(self.window, r.state.held + n), start + n
        return mels

    def _static(self, bucket: tuple[int, int]) -> tuple[Tensor, ...]:
        """The bucket's static inputs (a graph's): the states' are views of buffers for the largest
        bucket, shared by every bucket (one replays at a time)."""
        streams, frames = bucket
        if self._buffers is None:
            self._buffers = self._empty_state(self.stream_buckets[-1])
        keys, values, conv = self._buffers
        w = self._like()
        return (w.new_zeros(streams, frames, 80), w.new_zeros(streams, 80), w.new_zeros(streams, frames, 80),
                torch.zeros(3, streams, dtype=torch.long, device=w.device),
                keys[:, :, :streams], values[:, :, :streams], conv[:, :streams])

    def capture(self) -> int:
        """Capture every bucket's graph (CUDA): at start-up, never mid-traffic. Returns how many."""
        for bucket in self.buckets:
            self.graphs.capture(bucket)
        return len(self.buckets)

    def _solve(self, mu: Tensor, spks: Tensor, cond: Tensor, at: Tensor, keys: Tensor, values: Tensor,
               conv: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The Euler schedule of one bucket: mu, cond (S, Q, 80), spks (S, 80), at (3, S): each
        stream's first new frame, valid window frames and new frames; keys, values (steps, n_attn,
        S, 2, H, W, d) and conv (steps, S, 2, lp, ΣC): the states, overwritten in place with the
        next ones. Returns (mel (S, Q, 80) float32, keys, values, conv). The same arithmetic as
        CausalConditionalCFM.solve, row for row."""
        cfm, (streams, frames) = self.flow.decoder, mu.shape[:2]
        start, held, n_new = at
        bias, keep, keep_conv = WindowCall.masks(start, held, n_new, frames, self.window, self.chunk,
                                                 self.left_chunks, self.left_pad, mu.dtype)
        noise = cfm.rand_noise[0].t()  # (15000, 80)
        x = noise[(start[:, None] + torch.arange(frames, device=mu.device)).clamp(max=noise.shape[0] - 1)].to(mu.dtype)
        zeros = torch.zeros_like(mu)

        def rows(conditioned: Tensor) -> Tensor:  # (S, Q, 80) -> the CFG pair's rows (S·2·Q, 80)
            return torch.stack([conditioned, zeros], dim=1).view(-1, 80)

        mu_rows, spks_rows, cond_rows = rows(mu), rows(spks[:, None].expand(-1, frames, -1)), rows(cond)
        n = self.flow.n_timesteps
        t_span = 1 - torch.cos(torch.linspace(0, 1, n + 1, device=mu.device, dtype=mu.dtype) * 0.5 * torch.pi)
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, n + 1):
            call = WindowCall(keys[step - 1], values[step - 1], conv[step - 1], self.conv_at, bias, keep, keep_conv)
            v = self.estimator.run(torch.stack([x, x], dim=1).view(-1, 80), mu_rows, spks_rows, cond_rows, t, call)
            v = v.view(streams, 2, frames, 80)
            x = x + dt * ((1.0 + cfm.cfg_rate) * v[:, 0] - cfm.cfg_rate * v[:, 1])
            t = t + dt
            if step < n:
                dt = t_span[step + 1] - t
        return x.float(), keys, values, conv
