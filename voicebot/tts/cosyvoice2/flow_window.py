"""The streaming flow at bucketed static shapes, so that CUDA graphs capture it (issue 24).

The eager flow (flow.py, estimator.py `PackedCall`) shapes each call by its requests: the number of
streams, each one's new frames, each one's cached frames. Here a call of S streams of up to Q new
frames each runs at its bucket (S', Q'): S' the smallest of `stream_buckets` ≥ S, Q' the smallest
multiple of the 50-frame chunk ≥ Q, up to `max_frames`. Padded streams and frames are inert
(estimator.py `WindowCall`: masked keys, padded queries see only themselves, nothing of theirs is
read back). A stream's cache must be bounded: its window of W = left_chunks × 50 frames (the
official `num_decoding_left_chunks`), keys and values right-aligned in W frames, and its causal
convs' contexts.

Those states live in one `SlotPool`: tensors with a slot per rendering stream, which the graphs
read and write in place. A stream owns its slot for its life (`SlotState`): taken when the stream
opens (`open`), loaded from its voice's prompt state (a `WindowState`, outside the pool) by its
first render, freed when its last chunk renders, when it is closed, or when the stream object is
dropped (`Slot`). A call passes its streams' slot indices as a graph input: each attention layer
gathers its streams' windows from the pool by index and scatters the windows it keeps back, each
causal conv likewise its contexts, so nothing of a state is copied into or out of the graph
around the replay (issue 24: with a stack in, a copy into the static inputs and a copy out per
render, 8 streams at window 2 moved three copies of 1.8 GB a render at released size). Bounded:
`slots` streams (Token2Wav's `max_streams`; serving opens one stream per LM slot, and closes it
before the LM slot is given back), plus one scratch slot that a bucket's padding streams read and
write; opening a stream with none free raises `SlotsExhausted`.

Around the graph, a call's streams share their launches as well: one encoder pass over all their
tokens (Flow.encode_streaming, rows padded and masked), one gather each for the bucket's mu and
cond, one host-made index tensor for positions and slots.

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
import threading
import weakref
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
    """A voice's prompt state in a bucketed call's layout (what a stream's slot is loaded from):
    keys/values (steps, n_attn, 2, H, W, d) of the window's frames right-aligned, the last `held`
    valid; conv (steps, 2, lp, ΣC) every causal conv's last lp input frames; n_frames: the frames
    computed so far (the next call's start)."""

    keys: Tensor
    values: Tensor
    conv: Tensor
    held: int
    n_frames: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.conv))


class SlotsExhausted(RuntimeError):
    """Every slot of the pool is owned by an open stream."""


class Slot:
    """A stream's slot in the pool, owned until `release` (idempotent), called at the stream's last
    chunk or close, or when this object is dropped (the stream with it)."""

    def __init__(self, pool: SlotPool, index: int) -> None:
        self.pool, self.index = pool, index
        self.release = weakref.finalize(self, pool._free, index)

    @property
    def owned(self) -> bool:
        return self.release.alive


class SlotPool:
    """Every open stream's flow state, one slot each, in the tensors the bucketed graphs read and
    write in place: keys, values (steps, n_attn, slots + 1, 2, H, W, d), conv (steps, slots + 1, 2,
    lp, ΣC). Slot `slots` is the scratch slot, never owned: a bucket's padding streams read and
    write it, and nothing of it is ever read back. Bound: `slots` open streams (module docstring).
    Slots are taken on one thread (the renders'); `release` may come from any."""

    def __init__(self, keys: Tensor, values: Tensor, conv: Tensor) -> None:
        self.keys, self.values, self.conv = keys, values, conv
        self.slots = keys.shape[2] - 1
        self.scratch = self.slots
        self._free_slots = list(range(self.slots - 1, -1, -1))  # pop() takes the lowest
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free_slots)

    def slot_bytes(self) -> int:
        """The bytes of one slot (keys, values and conv contexts): what an open stream holds."""
        return sum(t[:, :, 0].numel() * t.element_size() for t in (self.keys, self.values)) \
            + self.conv[:, 0].numel() * self.conv.element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.conv))

    def take(self) -> Slot:
        with self._lock:
            if not self._free_slots:
                raise SlotsExhausted(f"all {self.slots} flow state slots are owned by open streams")
            index = self._free_slots.pop()
        return Slot(self, index)

    def _free(self, index: int) -> None:
        with self._lock:
            self._free_slots.append(index)

    def load(self, index: int, state: WindowState) -> None:
        """Slot `index` := a voice's prompt state (a stream's first render, before the graph's)."""
        self.keys[:, :, index].copy_(state.keys)
        self.values[:, :, index].copy_(state.values)
        self.conv[:, index].copy_(state.conv)


@dataclass
class SlotState:
    """A stream's flow state: its `slot` in the pool, the `held` valid window frames and the
    `n_frames` computed so far; `prompt`: the voice's state its first render loads into the slot
    (None once loaded)."""

    slot: Slot
    held: int
    n_frames: int
    prompt: WindowState | None

    def nbytes(self) -> int:
        return self.slot.pool.slot_bytes()


@dataclass
class WindowRequest:
    """One stream's chunk: prompt+target `tokens` (1, N) (the flow's own inputs, as FlowRequest),
    its voice's `prompt_feat` (1, 2P, 80) and `embedding` (1, 192); `finalize`: its last chunk."""

    tokens: Tensor
    prompt_feat: Tensor
    embedding: Tensor
    finalize: bool
    state: SlotState


class WindowFlow:
    def __init__(self, flow: Flow, left_chunks: int, stream_buckets: tuple[int, ...], max_frames: int,
                 max_streams: int, pool: tuple | None = None) -> None:
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
        self.slots = SlotPool(*self._empty_state(max_streams + 1))  # and the scratch slot
        self.graphs = BucketGraphs(self._solve, self._static, pool)

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
        """A voice's prompt state (flow.prompt_cache, windowed) in the layout of a slot, which the
        first render of each stream opened from it (`open`) loads into the stream's slot."""
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

    def open(self, prompt: WindowState) -> SlotState:
        """A new stream's state continuing a voice's prompt state, in a slot of its own (its first
        render loads it); SlotsExhausted when every slot is owned."""
        return SlotState(self.slots.take(), prompt.held, prompt.n_frames, prompt)

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
        for r in requests:  # a stream's first render: its slot starts from its voice's prompt state
            if r.state.prompt is not None:
                self.slots.load(r.state.slot.index, r.state.prompt)
                r.state.prompt = None
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
                             [r.state.held for r in requests] + [0] * empty, n_new + [0] * empty,
                             [r.state.slot.index for r in requests] + [self.slots.scratch] * empty], device)
        mel = self.graphs.run((streams, frames), (mu, spks, cond, at))[0]
        mel = mel[: len(requests)].clone()  # the streams' own rows of the graph's output (padding left behind)
        mels = []
        for s, (r, n) in enumerate(zip(requests, n_new)):
            start = r.state.n_frames
            skip = max(0, r.prompt_feat.shape[1] - start)  # the prompt's own frames are not returned
            mels.append(mel[s, skip:n].t()[None])
            r.state.held, r.state.n_frames = min(self.window, r.state.held + n), start + n
        return mels

    def _static(self, bucket: tuple[int, int]) -> tuple[Tensor, ...]:
        """The bucket's static inputs (a graph's): mu, spks, cond and the streams' positions and
        slots (the scratch slot's, so a capture writes no stream's state). The states are not
        inputs: the graph reads and writes the pool in place."""
        streams, frames = bucket
        w = self._like()
        at = torch.zeros(4, streams, dtype=torch.long, device=w.device)
        at[3] = self.slots.scratch
        return w.new_zeros(streams, frames, 80), w.new_zeros(streams, 80), w.new_zeros(streams, frames, 80), at

    def capture(self) -> int:
        """Capture every bucket's graph (CUDA): at start-up, never mid-traffic. Returns how many."""
        for bucket in self.buckets:
            self.graphs.capture(bucket)
        return len(self.buckets)

    def _solve(self, mu: Tensor, spks: Tensor, cond: Tensor, at: Tensor) -> tuple[Tensor]:
        """The Euler schedule of one bucket: mu, cond (S, Q, 80), spks (S, 80), at (4, S): each
        stream's first new frame, valid window frames, new frames and slot; the streams' states in
        the pool are overwritten in place with the next ones. Returns (mel (S, Q, 80) float32,).
        The same arithmetic as CausalConditionalCFM.solve, row for row."""
        cfm, (streams, frames) = self.flow.decoder, mu.shape[:2]
        start, held, n_new, slots = at
        pool = self.slots
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
            call = WindowCall(pool.keys[step - 1], pool.values[step - 1], pool.conv[step - 1], slots, self.conv_at,
                              bias, keep, keep_conv)
            v = self.estimator.run(torch.stack([x, x], dim=1).view(-1, 80), mu_rows, spks_rows, cond_rows, t, call)
            v = v.view(streams, 2, frames, 80)
            x = x + dt * ((1.0 + cfm.cfg_rate) * v[:, 0] - cfm.cfg_rate * v[:, 1])
            t = t + dt
            if step < n:
                dt = t_span[step + 1] - t
        return (x.float(),)
