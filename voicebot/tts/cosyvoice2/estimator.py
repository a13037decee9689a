"""The flow-matching vector-field estimator: CausalConditionalDecoder (spec §7.4).

A 1-D U-Net over mel frames with one resolution level (down, N mid, up), each stage a causal
ResNet block plus transformer blocks. Module and attribute names follow the checkpoint's keys
(`decoder.estimator.*` in flow.pt), which is why some containers keep parameter-less slots.

Every convolution pads on the left only, and streaming attention is block-causal, so the output
for a frame depends only on its own and earlier chunks. An `EstimatorCache` therefore lets a call
compute only new frames: it keeps each attention layer's keys/values and each causal conv's left
context from the earlier calls of the same Euler step.

One call serves any number of requests, packed time-major: each request is a `RequestRows` of 2·T
consecutive rows of one (R, C) tensor (its T frames conditioned, then the same T unconditioned:
the CFG pair), segments one after the other. Everything but the convolutions and attention works
row by row, so the linear layers, norms and activations of all requests run as one GEMM or one
element-wise pass each. A convolution is one GEMM too, over each row's kernel window gathered
with one index from its own segment's frames and cached left context; attention is one SDPA call
over all segments padded to the longest, masked per segment (`PackedCall`). So the number of
kernel launches of a call does not grow with the number of requests, and no value is read back
to the host. Batch 1 is the same code with one segment, with nothing padded.

The layers reach the other frames through the call only (`call.windows` for a causal conv,
`call.attention` for an attention layer), so the same network runs in a second layout: `WindowCall`,
the static shapes of a bucket (flow_window.py: streams × frames padded, windowed caches held in
fixed tensors), which a CUDA graph captures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicebot.tts.cosyvoice2.sampling import host_to_device


def chunk_mask(size: int, chunk_size: int, device: torch.device, start: int = 0, left_chunks: int = -1,
               key_start: int = 0) -> Tensor | None:
    """Block-causal attention mask, (size − start, size − key_start) bool, True where a query may attend.

    Position i sees every key j < (i // chunk_size + 1) * chunk_size: its own chunk and the earlier
    ones, all of them (left_chunks < 0) or the `left_chunks` before its own (the official
    `num_decoding_left_chunks`). Rows are the queries start … size−1 (a cached call computes only
    those), columns the keys key_start … size−1 (a windowed cache holds no earlier ones).
    chunk_size 0 means full attention, returned as None (no mask at all).
    """
    if chunk_size <= 0:
        return None
    pos = torch.arange(size, device=device)
    chunk = pos[start:] // chunk_size  # (size - start,)
    allowed = pos[None, key_start:] < ((chunk + 1) * chunk_size)[:, None]
    if left_chunks >= 0:
        allowed &= pos[None, key_start:] >= ((chunk - left_chunks) * chunk_size)[:, None]
    return allowed


def window_start(start: int, chunk_size: int, left_chunks: int) -> int:
    """The first frame a query at frame `start` or later may attend to (0 without a window)."""
    return 0 if left_chunks < 0 or chunk_size <= 0 else max(0, (start // chunk_size - left_chunks) * chunk_size)


class EstimatorCache:
    """Left context of one Euler step's estimator across chunked calls (batch = the CFG pair).

    Slot i of `keys`/`values` belongs to the attention layer whose `cache_slot` is i and holds its
    keys/values for this cache's own frames, from frame `own_start` on; `conv[i]` holds causal
    conv i's last kernel−1 input frames, (B, kernel−1, C) time-major.
    A request's cache is a `fork` of its voice's prompt state: the prompt's frames come first, read
    from the shared state and never written (about 1.2 GB per voice at released size, fp32); an
    attention layer copies its keys/values into one transient tensor for its SDPA call only.

    `left_chunks` is the attention window (the official `num_decoding_left_chunks`): a query sees
    its own chunk of `chunk_size` frames and, if ≥ 0, only that many chunks before it, else all of
    them. With a window the cache holds only the frames a later query may still see, at most
    left_chunks·chunk_size per layer: a stream's memory no longer grows with its reply.
    """

    def __init__(self, n_attn: int, n_conv: int, base: EstimatorCache | None = None, left_chunks: int = -1,
                 chunk_size: int = 0) -> None:
        if base is not None and base.base is not None:
            raise ValueError("fork a prompt state, not a fork")
        self.base = base
        self.left_chunks = base.left_chunks if base else left_chunks
        self.chunk_size = base.chunk_size if base else chunk_size
        self.n_frames = base.n_frames if base else 0
        self.own_start = self.n_frames  # the frame the own keys/values begin at
        # (B, H, own frames, d): frames own_start … n_frames, views of a tensor gathered by the call
        # that computed its last frames, shared with that call's other cached segments and padded
        # to the longest of them: freed once all of them have rendered again (at most one render
        # later in a scheduler's loop), and with a window never more than the window per segment
        self.keys: list[Tensor | None] = [None] * n_attn
        self.values: list[Tensor | None] = [None] * n_attn
        # Replaced, never written in place, so a fork can start from the base's tensors.
        self.conv: list[Tensor | None] = list(base.conv) if base else [None] * n_conv  # (B, kernel-1, C)

    def fork(self) -> EstimatorCache:
        """A request's cache that continues this one (a voice's prompt state) without copying it."""
        return EstimatorCache(len(self.keys), len(self.conv), base=self)

    def key_start(self, frame: int | None = None) -> int:
        """The first frame that queries from `frame` (default: the next new frame) on may see."""
        return window_start(self.n_frames if frame is None else frame, self.chunk_size, self.left_chunks)

    def advance(self, n_new: int) -> None:
        """The call that computed n_new more frames is over (its layers have replaced `keys`,
        `values` and `conv` with what they keep: frames PackedCall.kept_from … on)."""
        self.own_start = PackedCall.kept_from(self, self.n_frames + n_new)
        self.n_frames += n_new

    def tensors(self) -> list[Tensor]:
        """This cache's own tensors (a fork's base is counted with the voice)."""
        shared = set() if self.base is None else {id(t) for t in self.base.conv}
        return [t for t in (*self.keys, *self.values, *self.conv) if t is not None and id(t) not in shared]


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """softmax(q kᵀ / √d + bias) v for (B, H, T, d) inputs; bias is additive or a bool mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


@dataclass
class RequestRows:
    """One request's rows in a packed estimator call: its `n_new` frames, each as a conditioned and
    an unconditioned row (2·n_new rows). `cache`: its EstimatorCache of this Euler step, whose
    frames these follow and which grows by them (None: the frames start at 0, nothing is kept).
    `streaming`: block-causal attention in chunks of the estimator's static_chunk_size, else full;
    `left_chunks`: the chunks before its own that a query sees (< 0: all), the cache's if it has one."""

    n_new: int
    cache: EstimatorCache | None = None
    streaming: bool = True
    left_chunks: int = -1

    def __post_init__(self) -> None:
        if self.cache is not None:
            if not self.streaming:
                raise ValueError("a cached estimator call needs chunk-causal (streaming) attention")
            self.left_chunks = self.cache.left_chunks

    @property
    def start(self) -> int:
        return 0 if self.cache is None else self.cache.n_frames

    @property
    def key_start(self) -> int:
        """The first frame whose keys the segment's queries read (its cache holds none before)."""
        return 0 if self.cache is None else self.cache.key_start()


class PackedCall:
    """What the layers of one packed call share: each segment's rows, and the index plans with which
    every attention layer and causal conv serves all segments in one set of launches.

    Attention runs as one SDPA call over the segments padded to the longest one's queries and keys:
    a segment's keys (its voice's prompt frames, its own cached frames, its new frames: one
    concatenation for all segments) are gathered into (segments, CFG pair, heads, keys, d) with
    one index, and an additive bias masks each segment's chunks, window and padding. A cached
    segment's frames for the next call are gathered with one more index (a fresh tensor, shared by
    the call's segments, each holding a view). A causal conv gathers every row's kernel window
    from [new rows | cached contexts | a zero row] with one index as well. The indices are built
    here, on the host, from frame counts alone, and reach the device in one copy: no value is read
    back from the device. With one segment and nothing to pad, the gathers are skipped.
    """

    def __init__(self, segments: list[RequestRows], chunk_size: int, like: Tensor,
                 left_pads: tuple[int, ...] = (2,)) -> None:
        """left_pads: those of the causal convs that will run (a plan each)."""
        self.segments = segments
        self.rows: list[slice] = []
        n_rows = 0
        for seg in segments:
            if seg.cache is not None and seg.cache.chunk_size != chunk_size:
                raise ValueError(f"the cache is in chunks of {seg.cache.chunk_size} frames, "
                                 f"the estimator's {chunk_size}")
            self.rows.append(slice(n_rows, n_rows + 2 * seg.n_new))
            n_rows += 2 * seg.n_new
        self.n_rows = n_rows
        self.chunk_size = chunk_size
        self.cached = [i for i, seg in enumerate(segments) if seg.cache is not None]
        # a segment's keys: frames key_start … end; what its cache keeps of them: own_from … end
        self.key_start = [seg.key_start for seg in segments]
        self.ends = [seg.start + seg.n_new for seg in segments]
        self.own_from = {i: self.kept_from(segments[i].cache, self.ends[i]) for i in self.cached}
        self.q_max = max(seg.n_new for seg in segments)
        self.k_max = max(e - k for e, k in zip(self.ends, self.key_start))
        self.o_max = max((self.ends[i] - self.own_from[i] for i in self.cached), default=0)
        self.padded = len(segments) > 1  # one segment fills its batch exactly
        self._plans: dict[str, Tensor | None] = {}
        self._ints: list[int] = []
        self._offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._attention_plan()
        self.contexts = [i for i in self.cached if segments[i].start > 0]  # segments with conv context
        for left_pad in left_pads:
            self._conv_plan(left_pad)
        index = torch.tensor(self._ints, dtype=torch.long)
        if like.device.type == "cuda":  # pinned, so the copy does not wait for the device
            index = index.pin_memory()
        index = index.to(like.device, non_blocking=True)
        self._plans = {name: index[at : at + math.prod(shape)].view(shape)
                       for name, (at, shape) in self._offsets.items()}
        self.bias = self._attention_bias(like)

    @staticmethod
    def kept_from(cache: EstimatorCache, end: int) -> int:
        """The first frame the cache keeps after a call ending at `end` (EstimatorCache.advance)."""
        if cache.left_chunks < 0:
            return cache.own_start
        return max(cache.own_start, cache.key_start(end))

    def _add(self, name: str, values: list[int], shape: tuple[int, ...]) -> None:
        self._offsets[name] = (len(self._ints), shape)
        self._ints.extend(values)

    def plan(self, name: str) -> Tensor:
        return self._plans[name]

    def _attention_plan(self) -> None:
        segs, n_seg = self.segments, len(self.segments)
        if self.padded:
            q_index, out_index = [], []
            for i, (seg, rows) in enumerate(zip(segs, self.rows)):
                for half in range(2):
                    q_index += [rows.start + half * seg.n_new + min(t, seg.n_new - 1) for t in range(self.q_max)]
                    out_index += [(2 * i + half) * self.q_max + t for t in range(seg.n_new)]
            self._add("q", q_index, (n_seg * 2 * self.q_max,))
            self._add("out", out_index, (self.n_rows,))
        # the concatenated key blocks: per segment [base part | own cached part | new], in frame order
        self.blocks: list[tuple[int, int, int]] = []  # per segment: (base from, own from, new) frames
        key_index, own_index, offset = [], [], 0
        for i, seg in enumerate(segs):
            first, end = self.key_start[i], self.ends[i]
            cache = seg.cache
            base_frames = own_held = 0
            if cache is not None and cache.base is not None and first < cache.base.n_frames:
                base_frames = cache.base.n_frames - first
            if cache is not None and seg.start > cache.own_start:
                own_held = seg.start - max(first, cache.own_start)
            self.blocks.append((base_frames, own_held, seg.n_new))
            n_keys = end - first
            key_index += [offset + min(j, n_keys - 1) for j in range(self.k_max)]
            if i in self.own_from:
                kept = end - self.own_from[i]
                own_index += [offset + n_keys - kept + min(j, kept - 1) if kept else offset for j in range(self.o_max)]
            offset += n_keys
        if self.padded:
            self._add("keys", key_index, (n_seg * self.k_max,))
        if self.cached and self.o_max:
            self._add("own", own_index, (len(self.cached) * self.o_max,))

    def _conv_plan(self, left_pad: int) -> None:
        """Rows of [x (R) | each context segment's (2·left_pad) | one zero row] for every row's
        window (R, left_pad + 1) and for every cached segment's next context."""
        ctx_at = {i: self.n_rows + 2 * left_pad * c for c, i in enumerate(self.contexts)}
        zero = self.n_rows + 2 * left_pad * len(self.contexts)

        def row(i: int, half: int, p: int) -> int:  # padded position p of segment i's half
            if p >= left_pad:
                return self.rows[i].start + half * self.segments[i].n_new + p - left_pad
            return ctx_at[i] + half * left_pad + p if i in ctx_at else zero

        windows, tails = [], []
        for i, seg in enumerate(self.segments):
            for half in range(2):
                for t in range(seg.n_new):
                    windows += [row(i, half, t + j) for j in range(left_pad + 1)]
        for i in self.cached:
            for half in range(2):
                tails += [row(i, half, self.segments[i].n_new + j) for j in range(left_pad)]
        self._add(f"conv{left_pad}", windows, (self.n_rows * (left_pad + 1),))
        self._add(f"tail{left_pad}", tails, (len(tails),))

    def attention(self, attn: Attention, qkv: Tensor) -> Tensor:
        """qkv (R, 3·inner) -> the heads' outputs (R, inner), every segment in one SDPA call over
        [prompt frames | own cached frames | new frames] padded to the longest (the class docstring);
        each cached segment keeps this call's keys and values (`_keep`)."""
        heads, d, inner = attn.heads, attn.head_dim, attn.heads * attn.head_dim
        k_blocks, v_blocks = [], []  # (2, H, frames, d) each, every segment's in frame order
        for seg, rows, (n_base, n_own, _) in zip(self.segments, self.rows, self.blocks):
            if n_base:
                base = seg.cache.base
                k_blocks.append(base.keys[attn.cache_slot][:, :, -n_base:])
                v_blocks.append(base.values[attn.cache_slot][:, :, -n_base:])
            if n_own:
                k_blocks.append(seg.cache.keys[attn.cache_slot][:, :, -n_own:])
                v_blocks.append(seg.cache.values[attn.cache_slot][:, :, -n_own:])
            new = qkv[rows].view(2, seg.n_new, 3, heads, d)
            k_blocks.append(new[:, :, 1].transpose(1, 2))
            v_blocks.append(new[:, :, 2].transpose(1, 2))
        keys, values = (torch.cat(b, dim=2) if len(b) > 1 else b[0] for b in (k_blocks, v_blocks))
        n_seg = len(self.segments)
        # 4-D (segments·2, H, frames, d), which SDPA's fused CPU kernel takes (5-D falls back to
        # its math path, 3x slower at these sizes)
        if self.padded:
            q = qkv[:, :inner].index_select(0, self.plan("q")).view(n_seg * 2, self.q_max, heads, d).transpose(1, 2)
            k, v = (t.index_select(2, self.plan("keys")).view(2, heads, n_seg, self.k_max, d).permute(2, 0, 1, 3, 4)
                    .reshape(n_seg * 2, heads, self.k_max, d) for t in (keys, values))
        else:
            q = qkv.view(2, self.q_max, 3, heads, d)[:, :, 0].transpose(1, 2)
            k, v = keys, values
        out = attend(q, k, v, self.bias).transpose(1, 2).reshape(n_seg * 2 * self.q_max, inner)
        if self.padded:
            out = out.index_select(0, self.plan("out"))
        if self.cached:
            self._keep(attn, keys, values)
        return out

    def _keep(self, attn: Attention, keys: Tensor, values: Tensor) -> None:
        """Each cached segment's keys/values from PackedCall.kept_from on, as views of one gathered
        tensor per call (not of `keys`, which holds prompt frames and, uncached, the whole qkv)."""
        n_cached, o_max = len(self.cached), self.o_max
        if o_max:
            kept_k, kept_v = (t.index_select(2, self.plan("own")).view(*t.shape[:2], n_cached, o_max, t.shape[3])
                              for t in (keys, values))
        else:  # a window of 0 chunks keeps no frame
            kept_k = kept_v = keys.new_empty(*keys.shape[:2], n_cached, 0, keys.shape[3])
        for c, i in enumerate(self.cached):
            cache, n_kept = self.segments[i].cache, self.ends[i] - self.own_from[i]
            cache.keys[attn.cache_slot] = kept_k[:, :, c, :n_kept]
            cache.values[attn.cache_slot] = kept_v[:, :, c, :n_kept]



    def windows(self, conv: CausalConv1d, x: Tensor) -> Tensor:
        """(R, C) -> every row's window of kernel frames (R, kernel·C), gathered with one index from
        [x | each segment's cached context | a zero row]; each cached segment's context is replaced
        by its last kernel−1 input frames."""
        lp = conv.left_pad
        contexts = [self.segments[i].cache.conv[conv.cache_slot].reshape(2 * lp, -1) for i in self.contexts]
        src = torch.cat([x, *contexts, x.new_zeros(1, x.shape[1])])
        if self.cached:
            tails = src.index_select(0, self.plan(f"tail{lp}")).view(len(self.cached), 2, lp, -1)
            for tail, i in zip(tails, self.cached):
                self.segments[i].cache.conv[conv.cache_slot] = tail
        return src.index_select(0, self.plan(f"conv{lp}")).view(self.n_rows, -1)

    def _attention_bias(self, like: Tensor) -> Tensor | None:
        """(segments·2, 1, queries, keys) additive bias (the CFG pair's rows share theirs): each
        query sees the keys of its own chunk
        and of the chunks its window allows, none of another segment's padding. None where every
        query sees every key (one segment, its queries within one chunk, or full attention)."""
        segs = self.segments
        chunks = [self.chunk_size if seg.streaming and self.chunk_size > 0 else 0 for seg in segs]
        if not self.padded and (chunks[0] == 0 or segs[0].start // chunks[0] == (self.ends[0] - 1) // chunks[0]):
            return None
        big = max(self.ends) + 1  # a chunk this long is full attention
        params = host_to_device([[seg.start, seg.n_new, k, e - k, c or big, seg.left_chunks]
                                 for seg, k, e, c in zip(segs, self.key_start, self.ends, chunks)], like.device)
        start, n_new, first, n_keys, chunk, left = params.unbind(1)
        t = torch.arange(self.q_max, device=like.device)
        j = torch.arange(self.k_max, device=like.device)
        q_pos = (start[:, None] + torch.minimum(t[None], n_new[:, None] - 1))  # (S, Q); padding repeats the last
        k_pos = (first[:, None] + j[None])[:, None, :]  # (S, 1, K)
        q_chunk = (q_pos // chunk[:, None])[:, :, None]  # (S, Q, 1)
        c = chunk[:, None, None]
        allowed = (k_pos < (q_chunk + 1) * c) & (j[None, None] < n_keys[:, None, None])
        allowed &= (left[:, None, None] < 0) | (k_pos >= (q_chunk - left[:, None, None]) * c)
        bias = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(~allowed, -torch.inf)
        return bias[:, None].expand(-1, 2, -1, -1).reshape(len(segs) * 2, 1, self.q_max, self.k_max)


class WindowCall:
    """One Euler step's estimator call at a bucket's static shapes (flow_window.py): S streams of Q
    new frames each, rows (S, CFG pair, Q) time-major, a stream's rows past its `n_new` padding;
    each stream's cache lives in its slot of the pool (`slots` (S,): the streams' slot indices):
    a window of W frames held right-aligned in `keys`/`values` (n_attn, slots, 2, H, W, d), its
    last `held` valid, and its causal convs' contexts in `conv` (slots, 2, lp, ΣC), conv i's
    channels at `conv_at[i]`. Attention runs over [window | new frames], the windows gathered from
    the pool by slot, with `bias` masking each stream's chunks, window, invalid and padded frames
    (a padded query sees only itself); afterwards each stream's window and contexts are scattered
    back to its slot: its last W frames and last lp input frames (`keep`, `keep_conv`: their
    positions in [window | new]). Shapes depend on (S, Q, W) only and no value is read back to the
    host: a CUDA graph captures it.
    """

    def __init__(self, keys: Tensor, values: Tensor, conv: Tensor, slots: Tensor, conv_at: list[int], bias: Tensor,
                 keep: Tensor, keep_conv: Tensor) -> None:
        self.keys, self.values, self.conv, self.slots, self.conv_at = keys, values, conv, slots, conv_at
        self.bias, self.keep, self.keep_conv = bias, keep, keep_conv
        self.streams, self.window = slots.shape[0], keys.shape[4]
        self.frames = bias.shape[2]  # Q

    @staticmethod
    def masks(start: Tensor, held: Tensor, n_new: Tensor, frames: int, window: int, chunk: int, left_chunks: int,
              left_pad: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """(bias (S·2, 1, Q, W+Q), keep (S, W), keep_conv (S, lp)) for streams whose new frames begin
        at frame `start` (S,), after `held` (S,) valid window frames, `n_new` (S,) of them valid."""
        i = torch.arange(frames, device=start.device)
        p = torch.arange(window + frames, device=start.device)
        q_frame = start[:, None, None] + i[None, :, None]  # (S, Q, 1)
        k_frame = start[:, None, None] - window + p[None, None, :]  # (S, 1, W+Q): the window, then the new frames
        q_chunk = q_frame // chunk
        valid = torch.where(p[None] < window, p[None] >= window - held[:, None], p[None] - window < n_new[:, None])
        allowed = valid[:, None] & (k_frame < (q_chunk + 1) * chunk) & (k_frame >= (q_chunk - left_chunks) * chunk)
        padded_query = (i[None, :, None] >= n_new[:, None, None]) & (p[None, None] == window + i[None, :, None])
        allowed |= padded_query
        bias = torch.zeros(allowed.shape, dtype=dtype, device=start.device).masked_fill_(~allowed, -torch.inf)
        bias = bias[:, None].expand(-1, 2, -1, -1).reshape(-1, 1, frames, window + frames)
        keep = n_new[:, None] + torch.arange(window, device=start.device)[None]
        keep_conv = n_new[:, None] + torch.arange(left_pad, device=start.device)[None]
        return bias, keep, keep_conv

    def attention(self, attn: Attention, qkv: Tensor) -> Tensor:
        """qkv (R, 3·inner) -> the heads' outputs (R, inner); the stream's window keeps its last W frames."""
        s, q, w, h, d = self.streams, self.frames, self.window, attn.heads, attn.head_dim
        qkv = qkv.view(s, 2, q, 3, h, d).permute(3, 0, 1, 4, 2, 5)  # (3, S, 2, H, Q, d)
        pool_keys, pool_values = self.keys[attn.cache_slot], self.values[attn.cache_slot]  # (slots, 2, H, W, d)
        keys = torch.cat([pool_keys.index_select(0, self.slots), qkv[1]], dim=3)  # (S, 2, H, W+Q, d)
        values = torch.cat([pool_values.index_select(0, self.slots), qkv[2]], dim=3)
        out = attend(qkv[0].reshape(s * 2, h, q, d), keys.view(s * 2, h, w + q, d), values.view(s * 2, h, w + q, d),
                     self.bias)
        at = self.keep[:, None, None, :, None].expand(-1, 2, h, -1, d)
        pool_keys.index_copy_(0, self.slots, keys.gather(3, at))
        pool_values.index_copy_(0, self.slots, values.gather(3, at))
        return out.view(s, 2, h, q, d).permute(0, 1, 3, 2, 4).reshape(s * 2 * q, h * d)

    def windows(self, conv: CausalConv1d, x: Tensor) -> Tensor:
        """(R, C) -> every row's window of kernel frames (R, kernel·C) from [context | new rows];
        the stream's context becomes its last lp input frames."""
        s, q, lp, c = self.streams, self.frames, conv.left_pad, x.shape[1]
        at = self.conv_at[conv.cache_slot]
        contexts = self.conv[:, :, :, at : at + c]  # (slots, 2, lp, C), a view of the pool
        frames = torch.cat([contexts.index_select(0, self.slots), x.view(s, 2, q, c)], dim=2)  # (S, 2, lp+Q, C)
        contexts.index_copy_(0, self.slots, frames.gather(2, self.keep_conv[:, None, :, None].expand(-1, 2, -1, c)))
        return torch.cat([frames[:, :, j : j + q] for j in range(lp + 1)], dim=3).view(s * 2 * q, (lp + 1) * c)


def pointwise(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """A kernel-1 Conv1d on packed rows (R, C) -> (R, C'): a linear layer."""
    return F.linear(x, conv.weight[:, :, 0], conv.bias)


def add_linear(residual: Tensor, weight: Tensor, bias: Tensor, x: Tensor) -> Tensor:
    """residual + x @ weightᵀ + bias, the GEMM accumulating into residual + bias.

    One pass over the (R, C') output fewer than `residual + F.linear(x, weight, bias)`, which
    first copies the bias into a new output and then adds the residual to it in another.
    """
    return (residual + bias).addmm_(x, weight.t())


class CausalConv1d(nn.Conv1d):
    """Conv1d that pads only on the left, so output frame t sees inputs ≤ t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.left_pad = kernel_size - 1
        self.cache_slot = -1  # set by the decoder that owns it

    def forward(self, x: Tensor, call: PackedCall | WindowCall) -> Tensor:  # (R, C) -> (R, C')
        """As one GEMM over each row's window of kernel frames, which the call gathers for all its
        segments: a segment's cached context, the previous call's last input frames, stands in for
        the zero padding (zeros on its first call); the call keeps this one's for the next."""
        return F.linear(call.windows(self, x), self.window_weight(), self.bias)

    def window_weight(self) -> Tensor:
        """The weight as (C', kernel·C), in the gathered windows' (kernel, C) order; rebuilt when
        the parameter is replaced or written (as Attention.qkv_weight)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_window", None) is None or self._window[1] != key:
            with torch.inference_mode(False), torch.no_grad():
                self._window = self.weight.permute(0, 2, 1).reshape(self.out_channels, -1).contiguous(), key
        return self._window[0]


class CausalBlock1D(nn.Module):
    """CausalConv1d(k=3) → LayerNorm over channels → Mish."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        # indices are checkpoint keys: block.0 (conv) and block.2 (norm); 1 and 3 were transposes
        self.block = nn.Sequential(CausalConv1d(dim, dim_out, 3), nn.Identity(), nn.LayerNorm(dim_out), nn.Identity(),
                                   nn.Mish())

    def forward(self, x: Tensor, call: PackedCall) -> Tensor:  # (R, C) -> (R, C')
        conv, _, norm, _, act = self.block
        return act(norm(conv(x, call)))


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, temb: Tensor, call: PackedCall) -> Tensor:
        """x (R, C), temb (1, E): every row of a call is at the same flow time."""
        h = self.block1(x, call).add_(self.mlp(temb))
        return add_linear(self.block2(h, call), self.res_conv.weight[:, :, 0], self.res_conv.bias, x)


class Attention(nn.Module):
    """Self-attention without biases on q/k/v (diffusers `Attention` key layout)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # slot 1 was dropout
        self.cache_slot = -1  # set by the decoder that owns it
        self._qkv: tuple[Tensor, tuple] | None = None

    def qkv_weight(self) -> Tensor:
        """to_q, to_k and to_v as one (3·inner, dim) weight, so they run as one GEMM.

        The three parameters become views of it (no second copy); it is rebuilt whenever they
        are replaced or written (loading, `.to()`, cpu_weight_layout), which changes their storage
        or version. Built column-major, the layout loader.cpu_weight_layout found faster on CPU.
        """
        projs = (self.to_q, self.to_k, self.to_v)
        key = tuple((p.weight.data_ptr(), p.weight._version) for p in projs)
        if self._qkv is None or self._qkv[1] != key:
            with torch.inference_mode(False), torch.no_grad():  # parameters' data must not be inference tensors
                fused = torch.cat([p.weight.t() for p in projs], dim=1).t()
                for proj, part in zip(projs, fused.split(self.heads * self.head_dim)):
                    proj.weight.data = part
            self._qkv = fused, tuple((p.weight.data_ptr(), p.weight._version) for p in projs)
        return self._qkv[0]

    def heads_out(self, x: Tensor, call: PackedCall | WindowCall) -> Tensor:
        """(R, C) -> (R, inner): the heads' outputs before to_out (TransformerBlock adds that
        projection to its residual), every segment in one SDPA call (the call's); a cached
        segment's queries attend to its cached frames too, and its cache keeps this call's."""
        return call.attention(self, F.linear(x, self.qkv_weight()))


class GELUProjection(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))  # exact (erf) GELU, as the checkpoint was trained


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        # indices are checkpoint keys: net.0.proj and net.2; slot 1 was dropout
        self.net = nn.Sequential(GELUProjection(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim))

    def hidden(self, x: Tensor) -> Tensor:
        """(R, C) -> (R, mult·C): everything before the output projection net.2 (TransformerBlock
        adds that to its residual)."""
        return self.net[0](x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + GELU feed-forward (diffusers BasicTransformerBlock, self-attn only)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, call: PackedCall) -> Tensor:  # (R, C)
        out_proj, ff_proj = self.attn1.to_out[0], self.ff.net[2]
        x = add_linear(x, out_proj.weight, out_proj.bias, self.attn1.heads_out(self.norm1(x), call))
        hidden = self.ff.hidden(self.norm3(x))  # before x changes: the residual below is in place
        # x is this block's own tensor now: the second residual accumulates into it
        return x.add_(ff_proj.bias).addmm_(hidden, ff_proj.weight.t())


class TimestepEmbedding(nn.Module):
    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def sinusoidal_time_embedding(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    """(B,) flow time in [0, 1] -> (B, dim) [sin | cos] features; t is scaled by 1000 first."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angles = scale * t[:, None] * freqs[None, :]
    return torch.cat((angles.sin(), angles.cos()), dim=-1).to(t.dtype)


def _stage(dim_in: int, dim: int, time_dim: int, n_blocks: int, heads: int, head_dim: int, conv: bool) -> nn.ModuleList:
    """[resnet, transformer blocks(, causal conv)]: list indices are checkpoint keys."""
    parts: list[nn.Module] = [
        CausalResnetBlock1D(dim_in, dim, time_dim),
        nn.ModuleList(TransformerBlock(dim, heads, head_dim) for _ in range(n_blocks)),
    ]
    if conv:
        parts.append(CausalConv1d(dim, dim, 3))
    return nn.ModuleList(parts)


class CausalConditionalDecoder(nn.Module):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        channels: list[int],
        attention_head_dim: int,
        n_blocks: int,
        num_mid_blocks: int,
        num_heads: int,
        static_chunk_size: int,
    ) -> None:
        super().__init__()
        if len(channels) != 1:
            # more levels would need the official strided down/upsamplers; no CosyVoice 2 config has them
            raise ValueError(f"estimator channels {channels}: only a single U-Net level is supported")
        ch = channels[0]
        time_dim = ch * 4
        self.in_channels = in_channels
        self.static_chunk_size = static_chunk_size
        self.time_mlp = TimestepEmbedding(in_channels, time_dim)
        block = dict(time_dim=time_dim, n_blocks=n_blocks, heads=num_heads, head_dim=attention_head_dim)
        self.down_blocks = nn.ModuleList([_stage(in_channels, ch, conv=True, **block)])
        self.mid_blocks = nn.ModuleList(_stage(ch, ch, conv=False, **block) for _ in range(num_mid_blocks))
        self.up_blocks = nn.ModuleList([_stage(2 * ch, ch, conv=True, **block)])
        self.final_block = CausalBlock1D(ch, ch)
        self.final_proj = nn.Conv1d(ch, out_channels, 1)
        # number the layers that keep left context, so a cache is a pair of flat lists
        for kind in (Attention, CausalConv1d):
            for slot, module in enumerate(m for m in self.modules() if isinstance(m, kind)):
                module.cache_slot = slot
        self.conv_left_pads = tuple({m.left_pad for m in self.modules() if isinstance(m, CausalConv1d)})

    def new_cache(self, left_chunks: int = -1) -> EstimatorCache:
        """An empty cache; `left_chunks` ≥ 0 bounds it to that attention window (EstimatorCache)."""
        n_attn, n_conv = (sum(isinstance(m, kind) for m in self.modules()) for kind in (Attention, CausalConv1d))
        return EstimatorCache(n_attn, n_conv, left_chunks=left_chunks, chunk_size=self.static_chunk_size)

    def forward(self, x: Tensor, mu: Tensor, spks: Tensor, cond: Tensor, t: Tensor, segments: list[RequestRows]) -> Tensor:
        """x, mu, spks, cond: (R, 80) packed rows (module docstring); t: () the flow time of all of
        them. Returns the velocity (R, 80); each segment's cache grows by its frames."""
        call = PackedCall(segments, self.static_chunk_size, x, self.conv_left_pads)
        if call.n_rows != x.shape[0]:
            raise ValueError(f"segments cover {call.n_rows} rows, the input has {x.shape[0]}")
        velocity = self.run(x, mu, spks, cond, t, call)
        for seg in segments:
            if seg.cache is not None:
                seg.cache.advance(seg.n_new)
        return velocity

    def run(self, x: Tensor, mu: Tensor, spks: Tensor, cond: Tensor, t: Tensor, call: PackedCall | WindowCall) -> Tensor:
        """The network over rows (R, 80) of the call's layout (`forward`; flow_window.py's static
        one), its causal convs and attention layers served by the call -> the velocity (R, 80)."""
        temb = self.time_mlp(sinusoidal_time_embedding(t.reshape(1), self.in_channels))  # (1, 4·ch)
        x = torch.cat([x, mu, spks, cond], dim=1)  # (R, 320)

        def transformers(h: Tensor, blocks: nn.ModuleList) -> Tensor:
            for blk in blocks:
                h = blk(h, call)
            return h

        resnet, blocks, conv = self.down_blocks[0]
        x = transformers(resnet(x, temb, call), blocks)
        skip = x
        x = conv(x, call)
        for resnet, blocks in self.mid_blocks:
            x = transformers(resnet(x, temb, call), blocks)
        resnet, blocks, conv = self.up_blocks[0]
        x = transformers(resnet(torch.cat([x, skip], dim=1), temb, call), blocks)
        x = conv(x, call)
        x = self.final_block(x, call)
        return pointwise(self.final_proj, x)


def build_estimator(hp: dict[str, Any]) -> CausalConditionalDecoder:
    return CausalConditionalDecoder(
        in_channels=hp["in_channels"],
        out_channels=hp["out_channels"],
        channels=list(hp["channels"]),
        attention_head_dim=hp["attention_head_dim"],
        n_blocks=hp["n_blocks"],
        num_mid_blocks=hp["num_mid_blocks"],
        num_heads=hp["num_heads"],
        static_chunk_size=hp["static_chunk_size"],
    )
