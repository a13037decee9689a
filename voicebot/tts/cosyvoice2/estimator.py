"""The flow-matching vector-field estimator: CausalConditionalDecoder (spec §7.4).

A 1-D U-Net over mel frames with one resolution level (down, N mid, up), each stage a causal
ResNet block plus transformer blocks. Module and attribute names follow the checkpoint's keys
(`decoder.estimator.*` in flow.pt), which is why some containers keep parameter-less slots.

Every convolution pads on the left only, and streaming attention is block-causal, so the output
for a frame depends only on its own and earlier chunks. An `EstimatorCache` therefore lets a call
compute only new frames: it keeps each attention layer's keys/values and each causal conv's left
context from the earlier calls of the same Euler step.

One call serves any number of requests, packed time-major: each request is a `Segment` of 2·T
consecutive rows of one (R, C) tensor (its T frames conditioned, then the same T unconditioned:
the CFG pair), segments one after the other. Everything but the convolutions and attention works
row by row, so the linear layers, norms and activations of all requests run as one GEMM or one
element-wise pass each. A convolution is one GEMM too, over each row's kernel window gathered
from its own segment's frames and cached left context; attention runs per segment, over that
segment's own keys. Batch 1 is the same code with one segment. There is no padding, so no mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
        self.keys: list[Tensor | None] = [None] * n_attn  # (B, H, own frames, d)
        self.values: list[Tensor | None] = [None] * n_attn
        # Replaced, never written in place, so a fork can start from the base's tensors.
        self.conv: list[Tensor | None] = list(base.conv) if base else [None] * n_conv  # (B, kernel-1, C)

    def fork(self) -> EstimatorCache:
        """A request's cache that continues this one (a voice's prompt state) without copying it."""
        return EstimatorCache(len(self.keys), len(self.conv), base=self)

    def key_start(self, frame: int | None = None) -> int:
        """The first frame that queries from `frame` (default: the next new frame) on may see."""
        return window_start(self.n_frames if frame is None else frame, self.chunk_size, self.left_chunks)

    def extend_kv(self, slot: int, k: Tensor, v: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Append (B, H, T_new, d) keys/values after the cached frames; returns the keys/values of
        frames key_start() … end as blocks in frame order: the base's, then this cache's own."""
        end = self.n_frames + k.shape[2]
        first = self.key_start()
        blocks = []
        if self.base is not None and self.base.keys[slot] is not None and first < self.base.n_frames:
            skip = first - self.base.own_start  # a windowed prompt state holds only its last frames
            blocks.append((self.base.keys[slot][:, :, skip:], self.base.values[slot][:, :, skip:]))
        if self.left_chunks < 0:  # everything stays: grow the buffers in place
            start = self.n_frames - self.own_start
            self.keys[slot] = buf_k = _ensure_capacity(self.keys[slot], k, start + k.shape[2])
            self.values[slot] = buf_v = _ensure_capacity(self.values[slot], v, start + k.shape[2])
            buf_k[:, :, start : start + k.shape[2]] = k
            buf_v[:, :, start : start + k.shape[2]] = v
            own_k, own_v = buf_k[:, :, : start + k.shape[2]], buf_v[:, :, : start + k.shape[2]]
        else:
            own_k, own_v = (new if held is None else torch.cat([held, new], dim=2)
                            for held, new in ((self.keys[slot], k), (self.values[slot], v)))
            # keep only what the next call's queries may see, as a copy that holds nothing else
            keep = self.key_start(end) - self.own_start
            self.keys[slot], self.values[slot] = (t[:, :, keep:].clone() if keep > 0 else t for t in (own_k, own_v))
        skip = max(0, first - self.own_start)
        blocks.append((own_k[:, :, skip:], own_v[:, :, skip:]))
        return blocks

    def advance(self, n_new: int) -> None:
        """The call that extended every layer by n_new frames is over."""
        self.n_frames += n_new
        if self.left_chunks >= 0:
            self.own_start = max(self.own_start, self.key_start())

    def tensors(self) -> list[Tensor]:
        """This cache's own tensors (a fork's base is counted with the voice)."""
        shared = set() if self.base is None else {id(t) for t in self.base.conv}
        return [t for t in (*self.keys, *self.values, *self.conv) if t is not None and id(t) not in shared]


def _ensure_capacity(buf: Tensor | None, new: Tensor, length: int) -> Tensor:
    """`buf` if it holds `length` frames along dim 2, else a copy exactly that long.

    Each call appends one streaming chunk (a hop: 50, 100, then 200 frames), so growing to fit it
    costs one copy per chunk, a small fraction of the chunk's own estimator work, and holds no
    frames that are never written. Doubling held up to twice what a request used: at released
    size a frame is 4.6 MB over the 10 Euler steps.
    """
    if buf is not None and buf.shape[2] >= length:
        return buf
    grown = new.new_empty(*new.shape[:2], length, new.shape[3])
    if buf is not None:
        grown[:, :, : buf.shape[2]] = buf
    return grown


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """softmax(q kᵀ / √d + bias) v for (B, H, T, d) inputs; bias is additive or a bool mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def attend_blocks(q: Tensor, blocks: list[tuple[Tensor, Tensor]], bias: Tensor | None) -> Tensor:
    """`attend` over keys/values given as consecutive blocks along the frame axis (the voice's
    shared prompt frames, then the request's own); `bias` is additive, (T, all frames).

    The blocks are concatenated for one SDPA call: a transient copy of one layer's keys/values,
    freed at once, never written to the shared state. Attending block by block (scores per block,
    one softmax, one product per block) avoided that copy but took 1.4-2.4x as long as copy + SDPA
    at the streaming chunks' sizes (bench/flow.py, cached chunk).
    """
    if len(blocks) == 1:
        return attend(q, *blocks[0], bias)
    keys, values = (torch.cat(parts, dim=2) for parts in zip(*blocks))
    return attend(q, keys, values, bias)


@dataclass
class Segment:
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
    """What the layers of one packed call share: each segment's rows and its attention bias."""

    def __init__(self, segments: list[Segment], chunk_size: int, like: Tensor) -> None:
        self.segments = segments
        self.rows: list[slice] = []
        n_rows = 0
        for seg in segments:
            if seg.cache is not None and seg.cache.chunk_size != chunk_size:
                raise ValueError(f"the cache is in chunks of {seg.cache.chunk_size} frames, the estimator's {chunk_size}")
            self.rows.append(slice(n_rows, n_rows + 2 * seg.n_new))
            n_rows += 2 * seg.n_new
        self.n_rows = n_rows
        # additive, made once for every layer of the call: a bool mask is applied anew at each one
        self.biases = [_attention_bias(seg, chunk_size, like) for seg in segments]


def _attention_bias(seg: Segment, chunk_size: int, like: Tensor) -> Tensor | None:
    """(n_new, end − key_start) additive bias of the segment's queries, or None where every query
    sees every key (full attention, or new frames within one chunk): SDPA's fastest path. Decided
    from the frame numbers, so that no value is read back from the device."""
    chunk_size = chunk_size if seg.streaming else 0
    end = seg.start + seg.n_new
    if chunk_size <= 0 or seg.start // chunk_size == (end - 1) // chunk_size:
        return None  # one chunk of queries: its window starts at key_start, its keys end at `end`
    allowed = chunk_mask(end, chunk_size, like.device, seg.start, seg.left_chunks, seg.key_start)
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(~allowed, -torch.inf)


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

    def forward(self, x: Tensor, call: PackedCall) -> Tensor:  # (R, C) -> (R, C')
        """As one GEMM: each row's window of kernel frames (C·kernel values, in the weight's
        (C, kernel) order) is gathered first. A segment's cached context, the previous call's last
        input frames, stands in for the zero padding (zeros on its first call)."""
        k = self.kernel_size[0]
        windows = x.new_empty(call.n_rows, x.shape[1], k)
        for seg, rows in zip(call.segments, call.rows):
            frames = x[rows].view(2, seg.n_new, -1)
            context = None if seg.cache is None else seg.cache.conv[self.cache_slot]
            if context is None:
                context = frames.new_zeros(2, self.left_pad, frames.shape[2])
            padded = torch.cat([context, frames], dim=1)  # (2, left_pad + n_new, C)
            if seg.cache is not None:
                seg.cache.conv[self.cache_slot] = padded[:, -self.left_pad :].clone()  # not a view of the chunk
            windows[rows].view(2, seg.n_new, -1, k).copy_(padded.unfold(1, k, 1))
        return F.linear(windows.view(call.n_rows, -1), self.weight.view(self.out_channels, -1), self.bias)


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

    def heads_out(self, x: Tensor, call: PackedCall) -> Tensor:
        """(R, C) -> (R, inner): the heads' outputs before to_out (TransformerBlock adds that
        projection to its residual); a cached segment's rows attend to its cached frames too."""
        qkv = F.linear(x, self.qkv_weight())  # (R, 3·inner)
        outs = []
        for seg, rows, bias in zip(call.segments, call.rows, call.biases):
            shape = (2, seg.n_new, 3, self.heads, self.head_dim)
            q, k, v = qkv[rows].view(shape).permute(2, 0, 3, 1, 4)  # each (2, H, n_new, d)
            if seg.cache is None:
                o = attend(q, k, v, bias)
            else:
                o = attend_blocks(q, seg.cache.extend_kv(self.cache_slot, k, v), bias)
            # a view, no copy, where SDPA wrote (2, n_new, H, d) (its CPU flash kernel does)
            outs.append(o.transpose(1, 2).reshape(2 * seg.n_new, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


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

    def new_cache(self, left_chunks: int = -1) -> EstimatorCache:
        """An empty cache; `left_chunks` ≥ 0 bounds it to that attention window (EstimatorCache)."""
        n_attn, n_conv = (sum(isinstance(m, kind) for m in self.modules()) for kind in (Attention, CausalConv1d))
        return EstimatorCache(n_attn, n_conv, left_chunks=left_chunks, chunk_size=self.static_chunk_size)

    def forward(self, x: Tensor, mu: Tensor, spks: Tensor, cond: Tensor, t: Tensor, segments: list[Segment]) -> Tensor:
        """x, mu, spks, cond: (R, 80) packed rows (module docstring); t: () the flow time of all of
        them. Returns the velocity (R, 80); each segment's cache grows by its frames."""
        call = PackedCall(segments, self.static_chunk_size, x)
        if call.n_rows != x.shape[0]:
            raise ValueError(f"segments cover {call.n_rows} rows, the input has {x.shape[0]}")
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
        for seg in segments:
            if seg.cache is not None:
                seg.cache.advance(seg.n_new)
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
