"""The flow-matching vector-field estimator: CausalConditionalDecoder (spec §7.4).

A 1-D U-Net over mel frames with one resolution level (down, N mid, up), each stage a causal
ResNet block plus transformer blocks. Module and attribute names follow the checkpoint's keys
(`decoder.estimator.*` in flow.pt), which is why some containers keep parameter-less slots.

Every convolution pads on the left only, and streaming attention is block-causal, so the output
for a frame depends only on its own and earlier chunks. An `EstimatorCache` therefore lets a call
compute only new frames: it keeps each attention layer's keys/values and each causal conv's left
context from the earlier calls of the same Euler step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def chunk_mask(size: int, chunk_size: int, device: torch.device, start: int = 0) -> Tensor | None:
    """Block-causal attention mask, (size − start, size) bool, True where a query may attend.

    Position i sees every key j < (i // chunk_size + 1) * chunk_size: its own chunk and all
    earlier ones. Rows are the queries start … size−1 (a cached call computes only those).
    chunk_size 0 means full attention, returned as None (no mask at all).
    """
    if chunk_size <= 0:
        return None
    pos = torch.arange(size, device=device)
    limit = (pos[start:] // chunk_size + 1) * chunk_size  # (size - start,)
    return pos[None, :] < limit[:, None]


class EstimatorCache:
    """Left context of one Euler step's estimator across chunked calls (batch = the CFG pair).

    Slot i of `keys`/`values` belongs to the attention layer whose `cache_slot` is i and holds its
    keys/values for this cache's frames; `conv[i]` holds causal conv i's last kernel−1 input frames.
    A request's cache is a `fork` of its voice's prompt state: the prompt's frames come first, read
    from the shared state and never written or copied (about 1.2 GB per voice at released size, fp32).
    """

    def __init__(self, n_attn: int, n_conv: int, base: EstimatorCache | None = None) -> None:
        if base is not None and base.base is not None:
            raise ValueError("fork a prompt state, not a fork")
        self.base = base
        self.n_frames = base.n_frames if base else 0
        self.keys: list[Tensor | None] = [None] * n_attn  # (B, H, own frames, d)
        self.values: list[Tensor | None] = [None] * n_attn
        # Replaced, never written in place, so a fork can start from the base's tensors.
        self.conv: list[Tensor | None] = list(base.conv) if base else [None] * n_conv

    def fork(self) -> EstimatorCache:
        """A request's cache that continues this one (a voice's prompt state) without copying it."""
        return EstimatorCache(len(self.keys), len(self.conv), base=self)

    def extend_kv(self, slot: int, k: Tensor, v: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Append (B, H, T_new, d) keys/values after the cached frames; returns every frame's
        keys/values as blocks in frame order: the base's, then this cache's own."""
        start = self.n_frames - (self.base.n_frames if self.base else 0)
        end = start + k.shape[2]
        self.keys[slot] = buf_k = _ensure_capacity(self.keys[slot], k, end)
        self.values[slot] = buf_v = _ensure_capacity(self.values[slot], v, end)
        buf_k[:, :, start:end] = k
        buf_v[:, :, start:end] = v
        own = (buf_k[:, :, :end], buf_v[:, :, :end])
        if self.base is None or self.base.keys[slot] is None:
            return [own]
        return [(self.base.keys[slot], self.base.values[slot]), own]

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
    """`attend` over keys/values given as consecutive blocks along the frame axis, without
    concatenating them (that would copy the voice's shared prompt keys at every call); `bias` is
    additive, (T, all frames)."""
    if len(blocks) == 1:
        return attend(q, *blocks[0], bias)
    q = q * q.shape[-1] ** -0.5
    scores = torch.cat([q @ k.transpose(-1, -2) for k, _ in blocks], dim=-1)  # (B, H, T, all frames)
    if bias is not None:
        scores += bias
    weights = scores.float().softmax(-1).to(q.dtype)  # fp32 softmax: fp16 sums of exps overflow
    out, start = None, 0
    for k, v in blocks:
        part = weights[..., start : start + k.shape[2]] @ v
        out = part if out is None else out.add_(part)
        start += k.shape[2]
    return out


class CausalConv1d(nn.Conv1d):
    """Conv1d that pads only on the left, so output frame t sees inputs ≤ t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.left_pad = kernel_size - 1
        self.cache_slot = -1  # set by the decoder that owns it

    def forward(self, x: Tensor, cache: EstimatorCache | None = None) -> Tensor:  # (B, C, T) -> (B, C', T)
        if cache is None:
            return super().forward(F.pad(x, (self.left_pad, 0)))
        # the previous call's last input frames stand in for the zero padding (zeros on the first call)
        context = cache.conv[self.cache_slot]
        x = F.pad(x, (self.left_pad, 0)) if context is None else torch.cat([context, x], dim=2)
        cache.conv[self.cache_slot] = x[:, :, -self.left_pad :]
        return super().forward(x)


class _Transpose12(nn.Module):
    """Lets LayerNorm over channels sit inside the Sequential whose indices are checkpoint keys."""

    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    """mask → CausalConv1d(k=3) → LayerNorm over channels → Mish → mask."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), _Transpose12(), nn.LayerNorm(dim_out), _Transpose12(), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor, cache: EstimatorCache | None = None) -> Tensor:
        """x (B, C, T), mask (B, 1, T)."""
        conv, to_btc, norm, to_bct, act = self.block
        return act(to_bct(norm(to_btc(conv(x * mask, cache))))) * mask


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, temb: Tensor, cache: EstimatorCache | None = None) -> Tensor:
        """x (B, C, T), temb (B, E)."""
        h = self.block1(x, mask, cache) + self.mlp(temb)[:, :, None]
        h = self.block2(h, mask, cache)
        return h + self.res_conv(x * mask)


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

    def forward(self, x: Tensor, mask: Tensor | None, cache: EstimatorCache | None = None) -> Tensor:
        """(B, T, C) -> (B, T, C); with a cache, x holds only the new frames and attends to all."""
        b, t, _ = x.shape
        q, k, v = (
            proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, d)
            for proj in (self.to_q, self.to_k, self.to_v)
        )
        if cache is None:
            out = attend(q, k, v, mask)  # (B, H, T, d)
        else:
            out = attend_blocks(q, cache.extend_kv(self.cache_slot, k, v), mask)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


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

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + GELU feed-forward (diffusers BasicTransformerBlock, self-attn only)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, mask: Tensor | None, cache: EstimatorCache | None = None) -> Tensor:  # (B, T, C)
        x = x + self.attn1(self.norm1(x), mask, cache)
        return x + self.ff(self.norm3(x))


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

    def new_cache(self) -> EstimatorCache:
        n_attn, n_conv = (sum(isinstance(m, kind) for m in self.modules()) for kind in (Attention, CausalConv1d))
        return EstimatorCache(n_attn, n_conv)

    def forward(
        self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, streaming: bool,
        cache: EstimatorCache | None = None,
    ) -> Tensor:
        """x, mu, cond: (B, 80, T); mask (B, 1, T); t (B,); spks (B, 80). Returns the velocity (B, 80, T).

        With a cache the T frames follow the cache's frames: they attend to those through the cached
        keys/values (streaming attention only) and the cache grows by T.
        """
        start = 0 if cache is None else cache.n_frames
        if cache is not None and not streaming:
            raise ValueError("a cached estimator call needs chunk-causal (streaming) attention")
        temb = self.time_mlp(sinusoidal_time_embedding(t, self.in_channels))  # (B, 4·ch)
        x = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.shape[-1]), cond], dim=1)  # (B, 320, T)
        # at batch 1 per CFG row there is no padding, so only the chunk structure constrains attention
        allowed = chunk_mask(start + x.shape[-1], self.static_chunk_size if streaming else 0, x.device, start)
        # Additive, made once for every layer of the call: a bool mask is applied anew at each one.
        attn_bias = None if allowed is None else torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill_(
            ~allowed, -torch.inf)

        def transformers(h: Tensor, blocks: nn.ModuleList) -> Tensor:  # (B, C, T) -> (B, C, T)
            h = h.transpose(1, 2)
            for blk in blocks:
                h = blk(h, attn_bias, cache)
            return h.transpose(1, 2)

        resnet, blocks, conv = self.down_blocks[0]
        x = transformers(resnet(x, mask, temb, cache), blocks)
        skip = x
        x = conv(x * mask, cache)
        for resnet, blocks in self.mid_blocks:
            x = transformers(resnet(x, mask, temb, cache), blocks)
        resnet, blocks, conv = self.up_blocks[0]
        x = transformers(resnet(torch.cat([x, skip], dim=1), mask, temb, cache), blocks)
        x = conv(x * mask, cache)
        x = self.final_block(x, mask, cache)
        if cache is not None:
            cache.n_frames += x.shape[-1]
        return self.final_proj(x * mask) * mask


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
