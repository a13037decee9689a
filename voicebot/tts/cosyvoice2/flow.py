"""Speech tokens → mel: CausalMaskedDiffWithXvec (spec §7).

    tokens ─ input_embedding ─ UpsampleConformerEncoder (×2 in time) ─ encoder_proj ─ mu
    mu, speaker, prompt mel ─ CausalConditionalCFM (10 Euler steps, CFG) ─ mel

Module and attribute names follow the keys of the official flow.pt so it loads with strict=True.
Everything except the 3-token lookahead conv is causal within 25-token (50-frame) chunks when
`streaming`, so frames of complete chunks do not change when later tokens arrive. The official
algorithm recomputes the whole prefix, prompt included, on every streaming call (`cache=None`
here). With a `FlowCache` the estimator — 97 % of the flow's time — computes only the new frames,
against per-Euler-step keys/values and conv context of the frames before them; the encoder (about
3 %) still runs over all tokens, as its output for earlier frames is not kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicebot.tts.cosyvoice2.estimator import (
    CausalConditionalDecoder,
    EstimatorCache,
    RequestRows,
    attend,
    build_estimator,
    chunk_mask,
)
from voicebot.tts.cosyvoice2.sampling import host_to_device

# The official CFM draws its starting noise once, on CPU, right after seeding with 0; every call
# uses a prefix of it, which caps one flow call at this many mel frames (300 s).
RAND_NOISE_SEED = 0
RAND_NOISE_FRAMES = 15000


def rel_pos_table(x: Tensor) -> Tensor:
    """ESPnet relative positional table (1, 2T−1, D) for x (B, T, D), offsets T−1 … 0 … −(T−1).

    Row r encodes offset T−1−r: sin on even dims, cos on odd dims, frequency 10000^(−2i/D).
    Computed in fp32 whatever x's dtype, as the official table is.
    """
    size, dim = x.shape[1], x.shape[2]
    pos = torch.arange(size - 1, -size, -1, device=x.device, dtype=torch.float32)[:, None]  # (2T-1, 1)
    freq = torch.exp(torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) * -(math.log(10000.0) / dim))
    table = torch.zeros(2 * size - 1, dim, device=x.device)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table[None].to(x.dtype)


def rel_shift(x: Tensor) -> Tensor:
    """(B, H, T, 2T−1) scores against the rel-pos table → (B, H, T, T) with entry (i, j) at offset i−j.

    The Transformer-XL trick: pad one zero column, reinterpret the rows, drop the first one.
    """
    b, h, t, n = x.shape
    x = F.pad(x, (1, 0)).view(b, h, n + 1, t)[:, :, 1:].reshape(b, h, t, n)
    return x[..., : n // 2 + 1]


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL relative positions (ESPnet "rel_selfattn")."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.d_k = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))  # content bias
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))  # position bias

    def forward(self, x: Tensor, pos_emb: Tensor, mask: Tensor | None) -> Tensor:
        """x (B, T, D), pos_emb (1, 2T−1, D), mask (T, T) bool or None -> (B, T, D)."""
        b, t, _ = x.shape
        q, k, v = (
            lin(x).view(b, t, self.heads, self.d_k).transpose(1, 2)  # (B, H, T, d)
            for lin in (self.linear_q, self.linear_k, self.linear_v)
        )
        p = self.linear_pos(pos_emb).view(1, -1, self.heads, self.d_k).transpose(1, 2)  # (1, H, 2T-1, d)
        # scores = ((q+u)·kᵀ + (q+v)·pᵀ) / √d; the position term enters attention as an additive bias
        bd = rel_shift((q + self.pos_bias_v[:, None]) @ p.transpose(-2, -1)) / math.sqrt(self.d_k)  # (B, H, T, T)
        if mask is not None:
            bd = bd.masked_fill(~mask, float("-inf"))
        out = attend(q + self.pos_bias_u[:, None], k, v, bd)  # (B, H, T, d)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm attention + feed-forward; no macaron half-step and no convolution module."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(dim, heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.norm_mha = nn.LayerNorm(dim, eps=1e-12)
        self.norm_ff = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: Tensor, pos_emb: Tensor, mask: Tensor | None) -> Tensor:  # (B, T, D)
        x = x + self.self_attn(self.norm_mha(x), pos_emb, mask)
        return x + self.feed_forward(self.norm_ff(x))


class LinearEmbed(nn.Module):
    """Linear → LayerNorm, then the ESPnet √D scaling of the positional-encoding step."""

    def __init__(self, dim_in: int, dim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(dim_in, dim), nn.LayerNorm(dim, eps=1e-5))
        self.xscale = math.sqrt(dim)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, Din) -> (B, T, D)
        return self.out(x) * self.xscale


class PreLookaheadLayer(nn.Module):
    """Residual conv block where frame t sees tokens t … t+lookahead (the only non-causal part)."""

    def __init__(self, channels: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, channels, lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, 3)

    def forward(self, seq: Tensor, frames: int) -> Tensor:
        """seq (B, T + lookahead, D): each row's embedded tokens, then the tokens after them that it
        sees (its lookahead context), then zeros -> (B, T, D) for its first T = `frames` positions."""
        h = F.leaky_relu(self.conv1(seq.transpose(1, 2)), 0.01)  # (B, D, T)
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))  # causal
        return h.transpose(1, 2) + seq[:, :frames]


class Upsample1D(nn.Module):
    """Nearest ×stride in time, then a causal conv (left pad 2·stride, kernel 2·stride+1)."""

    def __init__(self, channels: int, stride: int = 2) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, stride * 2 + 1)

    def forward(self, x: Tensor) -> Tensor:  # (B, D, T) -> (B, D, stride·T)
        x = x.repeat_interleave(self.stride, dim=2)
        return self.conv(F.pad(x, (self.stride * 2, 0)))


class UpsampleConformerEncoder(nn.Module):
    def __init__(
        self, input_size: int, dim: int, heads: int, hidden: int, num_blocks: int, chunk_size: int,
        lookahead: int, num_up_blocks: int = 4, stride: int = 2,
    ) -> None:
        super().__init__()
        self.chunk_size = chunk_size  # tokens; ×stride after upsampling
        self.embed = LinearEmbed(input_size, dim)
        # the official class hard-codes 512 here; the released model has dim 512 so this is identical
        self.pre_lookahead_layer = PreLookaheadLayer(dim, lookahead)
        self.encoders = nn.ModuleList(ConformerLayer(dim, heads, hidden) for _ in range(num_blocks))
        self.up_layer = Upsample1D(dim, stride)
        self.up_embed = LinearEmbed(dim, dim)
        self.up_encoders = nn.ModuleList(ConformerLayer(dim, heads, hidden) for _ in range(num_up_blocks))
        self.after_norm = nn.LayerNorm(dim, eps=1e-5)

    def forward(self, x: Tensor, context: Tensor, streaming: bool) -> Tensor:
        """x (B, T, Din) token embeddings; context (B, c, Din) lookahead tokens after x, c may be 0.

        Returns (B, stride·T, D).
        """
        seq = self.embed(torch.cat([x, context], dim=1))
        return self.run(F.pad(seq, (0, 0, 0, self.pre_lookahead_layer.lookahead - context.shape[1])), x.shape[1],
                        streaming)

    def run(self, seq: Tensor, frames: int, streaming: bool, lengths: Tensor | None = None) -> Tensor:
        """seq (B, T + lookahead, D): embedded tokens, each row's lookahead context after its own and
        zeros after that; T = `frames`. lengths (B,): each row's own tokens when rows are padded to T
        (their padding is masked out of attention; causal convolutions never read it), None: all T.
        Returns (B, stride·T, D), row b's first stride·lengths[b] its own."""
        mask = chunk_mask(frames, self.chunk_size if streaming else 0, seq.device)
        x = self.pre_lookahead_layer(seq, frames)
        pos_emb = rel_pos_table(x)
        for layer in self.encoders:
            x = layer(x, pos_emb, _own_keys(mask, lengths, frames))
        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        x = self.up_embed(x)
        pos_emb = rel_pos_table(x)
        stride = self.up_layer.stride
        mask = chunk_mask(x.shape[1], self.chunk_size * stride if streaming else 0, x.device)
        mask = _own_keys(mask, None if lengths is None else lengths * stride, x.shape[1])
        for layer in self.up_encoders:
            x = layer(x, pos_emb, mask)
        return self.after_norm(x)


def _own_keys(mask: Tensor | None, lengths: Tensor | None, size: int) -> Tensor | None:
    """The attention mask (T, T) or None, and with `lengths` (B,) each row's padding keys masked:
    (B, 1, T, T)."""
    if lengths is None:
        return mask
    own = (torch.arange(size, device=lengths.device)[None] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T)
    return own if mask is None else own & mask


def rand_noise(channels: int = 80) -> Tensor:
    """The fixed starting noise (1, channels, 15000) of the official CFM, without touching the global RNG."""
    gen = torch.Generator(device="cpu").manual_seed(RAND_NOISE_SEED)
    return torch.randn([1, channels, RAND_NOISE_FRAMES], generator=gen, device="cpu")


class FlowCache:
    """A stream's flow state: one EstimatorCache per Euler step, all covering the same frames.

    It only ever holds complete 50-frame chunks of a non-final call (their values are final),
    all of them or, with a window (`left_chunks` ≥ 0), the last left_chunks of them; a per-voice
    prompt state is one of these, and each request's state a `fork` of it.
    """

    def __init__(self, steps: list[EstimatorCache]) -> None:
        self.steps = steps

    @property
    def n_frames(self) -> int:
        return self.steps[0].n_frames

    @property
    def left_chunks(self) -> int:
        return self.steps[0].left_chunks

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for step in self.steps for t in step.tensors())

    def fork(self) -> FlowCache:
        """A request's state continuing this one (a voice's prompt state), which it reads and never copies."""
        return FlowCache([step.fork() for step in self.steps])


@dataclass
class CFMInput:
    """One request's conditions for the CFM, time-major: mu and cond (T, 80), spks (80,); its
    frames follow the cache's (from frame 0 without one)."""

    mu: Tensor
    spks: Tensor
    cond: Tensor
    streaming: bool
    cache: FlowCache | None = None
    left_chunks: int = -1  # the estimator's attention window in chunks (< 0: all); a cache's own if cached


class CausalConditionalCFM(nn.Module):
    """Conditional flow matching solved with Euler steps on a cosine time grid and CFG."""

    def __init__(self, estimator: CausalConditionalDecoder, cfg_rate: float, n_mels: int) -> None:
        super().__init__()
        self.estimator = estimator
        self.cfg_rate = cfg_rate
        # not part of the state dict, as in the official class (a plain attribute there); a buffer
        # here so that it moves with the module: copied from the host at each call, it made the
        # host wait for the device once per request
        self.register_buffer("rand_noise", rand_noise(n_mels), persistent=False)

    def solve(self, requests: list[CFMInput], n_timesteps: int) -> list[Tensor]:
        """The mel (1, 80, T) float32 of each request, all of them solved together: every Euler
        step is one estimator call over all requests' CFG pairs (estimator.py's packed rows).

        A request's frames start from the fixed noise at their own positions and attend, at every
        step, to that step's cached frames; each request's cache grows by its frames.
        """
        x, frames = [], []
        for r in requests:
            start = 0 if r.cache is None else r.cache.n_frames
            end = start + r.mu.shape[0]
            if end > self.rand_noise.shape[2]:
                raise ValueError(f"flow call up to mel frame {end} exceeds the fixed noise ({self.rand_noise.shape[2]})")
            x.append(self.rand_noise[0, :, start:end].t().to(r.mu.dtype))  # a buffer: on r.mu's device
            frames.append(r.mu.shape[0])
        x = torch.cat(x)  # (F, 80): every request's frames, once
        # the packed CFG rows: per request its frames conditioned, then with mu, spks and cond zeroed
        def packed(parts: list[Tensor]) -> Tensor:
            return torch.cat([p for part in parts for p in (part, torch.zeros_like(part))])

        mu = packed([r.mu for r in requests])
        spks = packed([r.spks.expand(r.mu.shape[0], -1) for r in requests])
        cond = packed([r.cond for r in requests])
        # each packed row's frame in x, and the conditioned and unconditioned rows of each frame:
        # made on the host from the frame counts, one copy to the device
        rows_of, conditioned, unconditioned = [], [], []
        for first, n in zip(accumulate([0, *frames[:-1]]), frames):
            rows_of += [*range(first, first + n)] * 2
            conditioned += range(2 * first, 2 * first + n)
            unconditioned += range(2 * first + n, 2 * first + 2 * n)
        rows_of, conditioned, unconditioned = host_to_device(
            rows_of + conditioned + unconditioned, x.device).split([len(rows_of), x.shape[0], x.shape[0]])
        t_span = 1 - torch.cos(torch.linspace(0, 1, n_timesteps + 1, device=x.device, dtype=x.dtype) * 0.5 * torch.pi)
        # t accumulates dt exactly as the official solver does, not read back from t_span
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, n_timesteps + 1):
            segments = [RequestRows(n, None if r.cache is None else r.cache.steps[step - 1], r.streaming, r.left_chunks)
                        for r, n in zip(requests, frames)]
            v = self.estimator(x[rows_of], mu, spks, cond, t, segments)
            x = x + dt * ((1.0 + self.cfg_rate) * v[conditioned] - self.cfg_rate * v[unconditioned])
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
        return [mel.t()[None].float() for mel in x.split(frames)]


@dataclass
class FlowRequest:
    """The arguments of one `Flow.inference` call (see there), for `Flow.render`."""

    token: Tensor
    prompt_token: Tensor
    prompt_feat: Tensor
    embedding: Tensor
    streaming: bool
    finalize: bool
    cache: FlowCache | None = None
    left_chunks: int = -1


class Flow(nn.Module):
    """CausalMaskedDiffWithXvec at inference."""

    def __init__(
        self, vocab_size: int, input_size: int, n_mels: int, spk_embed_dim: int, token_mel_ratio: int,
        lookahead: int, encoder: UpsampleConformerEncoder, decoder: CausalConditionalCFM, dim: int,
        n_timesteps: int = 10,
    ) -> None:
        super().__init__()
        self.token_mel_ratio = token_mel_ratio
        self.pre_lookahead_len = lookahead
        self.n_timesteps = n_timesteps
        self.input_embedding = nn.Embedding(vocab_size, input_size)
        self.spk_embed_affine_layer = nn.Linear(spk_embed_dim, n_mels)
        self.encoder = encoder
        self.encoder_proj = nn.Linear(dim, n_mels)
        self.decoder = decoder

    def encode(self, tokens: Tensor, finalize: bool, streaming: bool) -> Tensor:
        """(1, N) prompt+target tokens -> mu (1, ratio·N', 80); N' = N, or N−lookahead if not final.

        A non-final call holds back the last `lookahead` tokens: they only feed the lookahead conv.
        """
        x = self.input_embedding(tokens.long().clamp(min=0))  # (1, N, Din)
        split = x.shape[1] - (0 if finalize else self.pre_lookahead_len)
        x, context = x[:, :split], x[:, split:]
        return self.encoder_proj(self.encoder(x, context, streaming))

    def encode_streaming(self, tokens: list[Tensor], finalize: list[bool]) -> tuple[Tensor, list[int]]:
        """`encode` (streaming) of several requests' tokens (1, N_b) in one batch, rows padded to
        the longest: (mu (B, ratio·T, 80), each row's own frames). Row b equals its call alone but
        for the GEMMs' blocking: its padding is zeroed after the embedding, masked out of attention
        and after its lookahead context, where the causal convolutions never read it."""
        look = self.pre_lookahead_len
        own = [t.shape[1] - (0 if final else look) for t, final in zip(tokens, finalize)]  # tokens before the context
        seen = [t.shape[1] for t in tokens]  # with the context
        frames = max(own)
        width = frames + look
        device = tokens[0].device
        ids = torch.cat([F.pad(t.long().clamp(min=0), (0, width - t.shape[1])) for t in tokens])  # (B, T + lookahead)
        seen_t, own_t = host_to_device([seen, own], device)
        seq = self.encoder.embed(self.input_embedding(ids))
        seq = seq * (torch.arange(width, device=device)[None] < seen_t[:, None])[:, :, None].to(seq.dtype)
        mu = self.encoder_proj(self.encoder.run(seq, frames, True, own_t))
        return mu, [n * self.token_mel_ratio for n in own]

    def new_cache(self, left_chunks: int = -1) -> FlowCache:
        """An empty flow state; `left_chunks` ≥ 0 bounds the estimator's attention (and so what the
        state holds) to that many chunks before a query's own (estimator.EstimatorCache)."""
        return FlowCache([self.decoder.estimator.new_cache(left_chunks) for _ in range(self.n_timesteps)])

    @torch.inference_mode()
    def inference(
        self, token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor,
        streaming: bool, finalize: bool, cache: FlowCache | None = None, left_chunks: int = -1,
    ) -> Tensor:
        """token (1, N), prompt_token (1, P), prompt_feat (1, 2P, 80), embedding (1, 192).

        Returns the mel of the target tokens only, (1, 80, 2N) — or 2(N−lookahead) when not final —
        in fp32 whatever the module's dtype. With a cache (streaming only) it returns just the
        target frames after the cached ones, and a non-final call, which must end on a chunk
        boundary, adds its frames to the cache. `left_chunks` ≥ 0: streaming attention sees only
        that many chunks before a query's own (a cache's own window, which must agree).
        """
        request = FlowRequest(token, prompt_token, prompt_feat, embedding, streaming, finalize, cache, left_chunks)
        return self.render([request])[0]

    @torch.inference_mode()
    def render(self, requests: list[FlowRequest]) -> list[Tensor]:
        """`inference` for several requests at once: the encoder (3 % of the time) once over all
        streaming requests' tokens (encode_streaming) and on its own for each full-attention one,
        the estimator on all of them together. Each result equals its call alone."""
        inputs, skip = [], []
        tokens = [torch.cat([r.prompt_token, r.token], dim=1) for r in requests]
        streaming = [i for i, r in enumerate(requests) if r.streaming]
        encoded: dict[int, Tensor] = {}
        if len(streaming) > 1:
            mu, ends = self.encode_streaming([tokens[i] for i in streaming], [requests[i].finalize for i in streaming])
            encoded = {i: mu[k, :end] for k, (i, end) in enumerate(zip(streaming, ends))}
        for i, r in enumerate(requests):
            start = 0 if r.cache is None else r.cache.n_frames
            if r.cache is not None and r.cache.left_chunks != r.left_chunks:
                raise ValueError(f"a cache of window {r.cache.left_chunks} in a request of window {r.left_chunks}")
            inputs.append(self._conditions(tokens[i], r.prompt_feat, r.embedding, r.streaming, r.finalize, r.cache,
                                           r.left_chunks, encoded.get(i)))
            skip.append(max(0, r.prompt_feat.shape[1] - start))  # the prompt's own frames are not returned
        mels = self.decoder.solve(inputs, self.n_timesteps)
        return [mel[:, :, n:] for mel, n in zip(mels, skip)]

    @torch.inference_mode()
    def prompt_cache(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor,
                     left_chunks: int = -1) -> FlowCache:
        """A voice's reusable flow state: its prompt's complete chunks that no target token reaches.

        Prompt frames in the chunk that target tokens complete, or whose lookahead reaches a target
        token, depend on the text, so each request computes those itself.
        """
        chunk = self.encoder.chunk_size
        n_tokens = (prompt_token.shape[1] - self.pre_lookahead_len) // chunk * chunk
        cache = self.new_cache(left_chunks)
        if n_tokens > 0:
            tokens = prompt_token[:, : n_tokens + self.pre_lookahead_len]
            inputs = self._conditions(tokens, prompt_feat, embedding, True, False, cache, left_chunks)
            self.decoder.solve([inputs], self.n_timesteps)
        return cache

    def _conditions(
        self, tokens: Tensor, prompt_feat: Tensor, embedding: Tensor, streaming: bool, finalize: bool,
        cache: FlowCache | None, left_chunks: int = -1, mu: Tensor | None = None,
    ) -> CFMInput:
        """The CFM's input for prompt+target `tokens` (1, N), from the cache's end (or frame 0) on;
        mu (T, 80): their encoding, when made already (encode_streaming)."""
        if cache is not None and not streaming:
            raise ValueError("a cached flow call needs chunk-causal (streaming) attention")
        dtype = self.encoder_proj.weight.dtype
        embedding, prompt_feat = embedding.to(dtype), prompt_feat.to(dtype)
        spks = self.spk_embed_affine_layer(F.normalize(embedding, dim=1))[0]  # (80,)
        if mu is None:
            mu = self.encode(tokens, finalize, streaming)[0]  # (T, 80)
        start = 0 if cache is None else cache.n_frames
        chunk_frames = self.decoder.estimator.static_chunk_size
        if cache is not None and not finalize and mu.shape[0] % chunk_frames:
            raise ValueError(f"a cached non-final flow call must end on a chunk boundary ({mu.shape[0]} frames)")
        cond = torch.zeros_like(mu)
        n_prompt = min(prompt_feat.shape[1], mu.shape[0])
        cond[:n_prompt] = prompt_feat[0, :n_prompt]
        return CFMInput(mu[start:], spks, cond[start:], streaming, cache, left_chunks)


def build_flow(hp: dict[str, Any]) -> Flow:
    """Build from the `flow` section of cosyvoice2.yaml (as read by hparams.load_hparams)."""
    enc, dec = hp["encoder"], hp["decoder"]
    cfm = dec["cfm_params"].get("content", dec["cfm_params"])  # the yaml wraps it in an omegaconf DictConfig
    if cfm["solver"] != "euler" or cfm["t_scheduler"] != "cosine":
        raise ValueError(f"unsupported CFM solver/schedule: {cfm['solver']}/{cfm['t_scheduler']}")
    encoder = UpsampleConformerEncoder(
        input_size=enc["input_size"], dim=enc["output_size"], heads=enc["attention_heads"],
        hidden=enc["linear_units"], num_blocks=enc["num_blocks"], chunk_size=enc["static_chunk_size"],
        lookahead=hp["pre_lookahead_len"], stride=hp["token_mel_ratio"],
    )
    decoder = CausalConditionalCFM(build_estimator(dec["estimator"]), cfm["inference_cfg_rate"], hp["output_size"])
    return Flow(
        vocab_size=hp["vocab_size"], input_size=hp["input_size"], n_mels=hp["output_size"],
        spk_embed_dim=hp["spk_embed_dim"], token_mel_ratio=hp["token_mel_ratio"],
        lookahead=hp["pre_lookahead_len"], encoder=encoder, decoder=decoder, dim=enc["output_size"],
    )
