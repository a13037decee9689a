"""FunASR's streaming Paraformer (paraformer-zh-streaming), our own PyTorch, batched across streams.

One chunk step of B streams at once: SANM encoder over each stream's new LFR frames (with the
encoder look-back), the CIF predictor firing tokens with each stream's carried integrator, and the
SANM decoder over the fired token embeddings (with the decoder look-back). Module and parameter
names are FunASR's, so a released model.pt loads key for key (loader.py checks the manifest).

The arithmetic follows funasr 1.4.16's streaming path (models/paraformer_streaming/model.py
`inference` -> `generate_chunk`; scama/encoder.py `SANMEncoderChunkOpt.forward_chunk`;
sanm/attention.py; paraformer/cif_predictor.py `CifPredictorV2.forward_chunk`; paraformer/decoder.py
`ParaformerSANMDecoder.forward_chunk`) step for step; tests/asr/test_sanm_golden.py compares it
against fixtures funasr itself made. Where funasr does something surprising we do it too, and say so.

Shapes, with the released model's sizes: B streams in the step; d = 512 (encoder and decoder
width), F = 560 (80 mel bins x LFR 7), H = 4 heads of dk = 128; chunk_size = (c0, c1, c2) =
(0, 10, 5) LFR frames (60 ms each) of left context, new frames and look-ahead. A stream's encoder
input each step is its c0 + c2 frames kept from the last step followed by its c1 new ones, so T =
c0 + c1 + c2 = 15 frames; a stream that ends an utterance may bring fewer new frames, so rows are
padded to the longest and `valid` (B, T) marks the real frames. N is the most tokens any stream
fired this step. 50 encoder layers, 16 decoder layers, vocabulary V = 8404.

Batching changes nothing in a row's arithmetic except the order of additions inside matmuls:
padded keys are masked out of attention, padded frames are zeroed before every convolution (where
funasr pads with zeros at the row's own end) and carry zero CIF weight. A stream's result in a
batch equals its result alone (tests/asr/test_sanm_batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelArgs:
    """The architecture, as config.yaml's encoder_conf / decoder_conf / predictor_conf give it."""

    input_dim: int = 560  # n_mels * lfr_m
    dim: int = 512
    encoder_heads: int = 4
    encoder_ffn: int = 2048
    encoder_layers: int = 50
    encoder_kernel: int = 11  # FSMN memory block width
    encoder_sanm_shift: int = 0
    decoder_heads: int = 4
    decoder_ffn: int = 2048
    decoder_layers: int = 16
    decoder_kernel: int = 11
    decoder_sanm_shift: int = 5
    vocab_size: int = 8404
    cif_l_order: int = 1
    cif_r_order: int = 1
    cif_threshold: float = 1.0
    cif_tail_threshold: float = 0.45
    cif_smooth_factor: float = 1.0
    cif_noise_threshold: float = 0.0
    blank_id: int = 0
    sos: int = 1
    eos: int = 2

    @property
    def encoder_fsmn_padding(self) -> tuple[int, int]:
        return _fsmn_padding(self.encoder_kernel, self.encoder_sanm_shift)

    @property
    def decoder_fsmn_padding(self) -> tuple[int, int]:
        return _fsmn_padding(self.decoder_kernel, self.decoder_sanm_shift)


def _fsmn_padding(kernel: int, shift: int) -> tuple[int, int]:
    """(left, right) zero padding of a SANM FSMN block (sanm/attention.py)."""
    left = (kernel - 1) // 2 + (shift if shift > 0 else 0)
    return left, kernel - 1 - left


@dataclass(frozen=True)
class ChunkConfig:
    """Streaming geometry and look-backs (funasr's chunk_size, encoder/decoder_chunk_look_back)."""

    chunk_size: tuple[int, int, int] = (0, 10, 5)
    encoder_look_back: int = 4  # chunks of encoder keys/values kept; -1 unbounded, 0 none
    decoder_look_back: int = 1  # chunks of encoder output the decoder attends back to; 0 none

    def __post_init__(self) -> None:
        c0, c1, c2 = self.chunk_size
        if c0 < 0 or c1 < 1 or c2 < 1:
            # funasr slices its key cache with [:-c2], which keeps nothing when c2 == 0.
            raise ValueError(f"chunk_size {list(self.chunk_size)}: need c0 >= 0, c1 >= 1 and look-ahead c2 >= 1")
        if self.encoder_look_back < -1 or self.decoder_look_back < -1:
            raise ValueError("look-backs are chunk counts: -1 (unbounded), 0 or more")

    @property
    def stride_frames(self) -> int:
        return self.chunk_size[1]

    @property
    def overlap_frames(self) -> int:
        """Frames of the last step a stream's next encoder input starts with."""
        return self.chunk_size[0] + self.chunk_size[2]


class LayerNorm(nn.LayerNorm):
    """FunASR's LayerNorm: eps 1e-12."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, eps=1e-12)


def _attend(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor) -> Tensor:
    """Softmax attention. q (B, H, Tq, dk) already scaled; k, v (B, H, Tk, dk); key_valid (B, Tk).

    Returns (B, Tq, H*dk). Masked keys get probability exactly 0, so a row attends to exactly the
    keys funasr gives it alone.
    """
    scores = q @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
    masked = ~key_valid[:, None, None, :]
    attn = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1).masked_fill(masked, 0.0)
    out = attn @ v  # (B, H, Tq, dk)
    b, h, t, dk = out.shape
    return out.transpose(1, 2).reshape(b, t, h * dk)


def _heads(x: Tensor, heads: int) -> Tensor:
    """(B, T, H*dk) -> (B, H, T, dk)"""
    b, t, d = x.shape
    return x.view(b, t, heads, d // heads).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Encoder: SANM layers (self-attention plus an FSMN memory block over the values)
# ---------------------------------------------------------------------------------------------


class EncoderSelfAttention(nn.Module):
    """MultiHeadedAttentionSANM: one projection to q, k, v; the FSMN block is a depthwise conv over v."""

    def __init__(self, args: ModelArgs, in_dim: int) -> None:
        super().__init__()
        self.heads = args.encoder_heads
        self.linear_q_k_v = nn.Linear(in_dim, 3 * args.dim)
        self.linear_out = nn.Linear(args.dim, args.dim)
        self.fsmn_block = nn.Conv1d(args.dim, args.dim, args.encoder_kernel, groups=args.dim, bias=False)
        self.padding = args.encoder_fsmn_padding

    def forward(self, x: Tensor, valid: Tensor, past_k: Tensor, past_v: Tensor, past_valid: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, in_dim), valid (B, T); past_k/v (B, H, P, dk) from earlier chunks, past_valid (B, P).

        Returns the attention output plus FSMN memory (B, T, d) and this chunk's k, v (B, H, T, dk).
        """
        d = self.linear_out.in_features
        q, k, v = self.linear_q_k_v(x).split(d, dim=-1)  # 3 x (B, T, d)
        # FSMN memory: funasr convolves the row's own frames with zeros on both sides, no cache.
        v = v * valid[..., None]
        memory = self.fsmn_block(F.pad(v.transpose(1, 2), self.padding)).transpose(1, 2) + v
        q_h, k_h, v_h = _heads(q, self.heads), _heads(k, self.heads), _heads(v, self.heads)
        keys, values = torch.cat((past_k, k_h), dim=2), torch.cat((past_v, v_h), dim=2)
        dk = d // self.heads
        att = _attend(q_h * dk ** -0.5, keys, values, torch.cat((past_valid, valid), dim=1))
        return self.linear_out(att) + memory, k_h, v_h


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(torch.relu(self.w_1(x)))


class EncoderLayer(nn.Module):
    """Pre-norm SANM layer. The first layer maps F -> d and has no residual around its attention."""

    def __init__(self, args: ModelArgs, in_dim: int) -> None:
        super().__init__()
        self.norm1 = LayerNorm(in_dim)
        self.self_attn = EncoderSelfAttention(args, in_dim)
        self.norm2 = LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, args.encoder_ffn)
        self.residual = in_dim == args.dim

    def forward(self, x: Tensor, valid: Tensor, past_k: Tensor, past_v: Tensor, past_valid: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        att, k_h, v_h = self.self_attn(self.norm1(x), valid, past_k, past_v, past_valid)
        x = x + att if self.residual else att
        return x + self.feed_forward(self.norm2(x)), k_h, v_h


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dim = args.dim
        self.encoders0 = nn.ModuleList([EncoderLayer(args, args.input_dim)])
        self.encoders = nn.ModuleList([EncoderLayer(args, args.dim) for _ in range(args.encoder_layers - 1)])
        self.after_norm = LayerNorm(args.dim)

    @property
    def layers(self) -> list[EncoderLayer]:
        return [*self.encoders0, *self.encoders]


def sinusoidal_encoding(positions: Tensor, depth: int) -> Tensor:
    """FunASR's SinusoidalPositionEncoder.encode: positions (B, T) float32 -> (B, T, depth).

    Only the positions asked for (funasr's streaming encoder computes every position since the
    stream began and slices; same values, O(chunk) instead of O(stream))."""
    increment = torch.log(torch.tensor([10000.0], device=positions.device)) / (depth / 2 - 1)
    inv_timescales = torch.exp(torch.arange(depth / 2, device=positions.device) * -increment)
    scaled = positions[..., None] * inv_timescales  # (B, T, depth/2)
    return torch.cat((torch.sin(scaled), torch.cos(scaled)), dim=-1)


# ---------------------------------------------------------------------------------------------
# CIF predictor
# ---------------------------------------------------------------------------------------------


class CifPredictor(nn.Module):
    """CifPredictorV2: a weight in [0, 1] per encoder frame; a token fires each time the running sum
    crosses the threshold, its embedding the weighted sum of the frames it integrated."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.padding = (args.cif_l_order, args.cif_r_order)
        self.cif_conv1d = nn.Conv1d(args.dim, args.dim, args.cif_l_order + args.cif_r_order + 1)
        self.cif_output = nn.Linear(args.dim, 1)
        self.threshold = args.cif_threshold
        self.tail_threshold = args.cif_tail_threshold
        self.smooth_factor = args.cif_smooth_factor
        self.noise_threshold = args.cif_noise_threshold

    def weights(self, enc: Tensor) -> Tensor:
        """enc (B, T, d), zero at padded frames -> alphas (B, T)."""
        h = torch.relu(self.cif_conv1d(F.pad(enc.transpose(1, 2), self.padding))).transpose(1, 2)
        alphas = torch.sigmoid(self.cif_output(h))
        return torch.relu(alphas * self.smooth_factor - self.noise_threshold).squeeze(-1)

    def fire(self, enc: Tensor, alphas: Tensor) -> tuple[list[list[Tensor]], Tensor, Tensor]:
        """Integrate-and-fire over [carried frame, this chunk's frames, tail frame].

        enc (B, T+2, d) and alphas (B, T+2), the carried frame first and the tail last (the caller
        builds them). Returns each row's fired embeddings (list of (d,)), and the new carry: (B,)
        integrator and (B, d) hidden, funasr's `cif_alphas` / `cif_hidden` (the leftover frames
        divided by the leftover weight).

        The loop runs over time with all rows at once, in funasr's order of operations, so each
        row's values are bitwise funasr's.
        """
        b, t, d = enc.shape
        integrate = torch.zeros(b, dtype=enc.dtype, device=enc.device)
        frames = torch.zeros(b, d, dtype=enc.dtype, device=enc.device)
        fired: list[list[Tensor]] = [[] for _ in range(b)]
        for step in range(t):
            alpha, hidden = alphas[:, step], enc[:, step]
            fire = alpha + integrate >= self.threshold  # (B,)
            weight = torch.where(fire, self.threshold - integrate, alpha)
            frames = frames + weight[:, None] * hidden
            for row in fire.nonzero().flatten().tolist():
                fired[row].append(frames[row])
            integrate = integrate + alpha
            integrate = torch.where(fire, integrate - self.threshold, integrate)
            frames = torch.where(fire[:, None], integrate[:, None] * hidden, frames)
        hidden_carry = torch.where((integrate > 0)[:, None], frames / integrate[:, None], frames)
        return fired, integrate, hidden_carry


# ---------------------------------------------------------------------------------------------
# Decoder: SANM layers (feed-forward, causal FSMN over tokens, cross-attention to the encoder)
# ---------------------------------------------------------------------------------------------


class DecoderFSMN(nn.Module):
    """MultiHeadedAttentionSANMDecoder: a causal depthwise conv over the token sequence, with the
    last kernel-1 inputs of earlier chunks as its left context."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.fsmn_block = nn.Conv1d(args.dim, args.dim, args.decoder_kernel, groups=args.dim, bias=False)

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        """x (B, N, d), context (B, d, kernel-1) -> (B, N, d)."""
        return self.fsmn_block(torch.cat((context, x.transpose(1, 2)), dim=2)).transpose(1, 2) + x


class CrossAttention(nn.Module):
    """MultiHeadedAttentionCrossAtt: token queries over the encoder output (and its look-back)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.heads = args.decoder_heads
        self.linear_q = nn.Linear(args.dim, args.dim)
        self.linear_k_v = nn.Linear(args.dim, 2 * args.dim)
        self.linear_out = nn.Linear(args.dim, args.dim)

    def forward(self, x: Tensor, memory: Tensor, valid: Tensor, past_k: Tensor, past_v: Tensor, past_valid: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, N, d); memory (B, T, d) with valid (B, T); past_k/v (B, H, P, dk), past_valid (B, P)."""
        d = x.shape[-1]
        k, v = self.linear_k_v(memory).split(d, dim=-1)
        k_h, v_h = _heads(k, self.heads), _heads(v, self.heads)
        q_h = _heads(self.linear_q(x), self.heads) * (d // self.heads) ** -0.5
        att = _attend(q_h, torch.cat((past_k, k_h), dim=2), torch.cat((past_v, v_h), dim=2),
                      torch.cat((past_valid, valid), dim=1))
        return self.linear_out(att), k_h, v_h


class DecoderFeedForward(nn.Module):
    """PositionwiseFeedForwardDecoderSANM: a LayerNorm inside, no bias on the way out."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim, bias=False)
        self.norm = LayerNorm(hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.norm(torch.relu(self.w_1(x))))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.norm1 = LayerNorm(args.dim)
        self.feed_forward = DecoderFeedForward(args.dim, args.decoder_ffn)
        self.norm2 = LayerNorm(args.dim)
        self.self_attn = DecoderFSMN(args)
        self.norm3 = LayerNorm(args.dim)
        self.src_attn = CrossAttention(args)


class LastDecoderLayer(nn.Module):
    """decoders3: feed-forward only, and (as in funasr) no residual around it."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.norm1 = LayerNorm(args.dim)
        self.feed_forward = DecoderFeedForward(args.dim, args.decoder_ffn)

    def forward(self, x: Tensor) -> Tensor:
        return self.feed_forward(self.norm1(x))


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # Token embedding of training (sampling); inference feeds the CIF embeddings instead.
        self.embed = nn.Sequential(nn.Embedding(args.vocab_size, args.dim))
        self.decoders = nn.ModuleList([DecoderLayer(args) for _ in range(args.decoder_layers)])
        self.decoders3 = nn.ModuleList([LastDecoderLayer(args)])
        self.after_norm = LayerNorm(args.dim)
        self.output_layer = nn.Linear(args.dim, args.vocab_size)


# ---------------------------------------------------------------------------------------------
# Per-stream state and the batched chunk step
# ---------------------------------------------------------------------------------------------


@dataclass
class StreamState:
    """Everything one stream carries from one chunk step to the next (funasr's cache["encoder"] and
    cache["decoder"]); bounded: the look-backs bound the key/value caches (unless -1)."""

    position: int  # LFR frames embedded so far (funasr's start_idx)
    overlap: Tensor  # (c0+c2, F): the last step's final frames, after scaling and positions
    encoder_kv: Tensor | None  # (layers, 2, H, P, dk): keys/values of earlier chunks, or None
    cif_alpha: Tensor  # (): weight integrated since the last token fired
    cif_hidden: Tensor  # (d,): those frames' weighted mean
    decoder_context: Tensor | None  # (layers, d, kernel-1): last FSMN inputs, None before any token
    decoder_kv: Tensor | None  # (layers, 2, H, P, dk): encoder output keys/values of earlier chunks

    def nbytes(self) -> int:
        tensors = (self.overlap, self.encoder_kv, self.cif_alpha, self.cif_hidden, self.decoder_context, self.decoder_kv)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class ChunkOutput:
    """One stream's result of a chunk step (the encoder/CIF values are for tests and fixtures)."""

    token_ids: list[int]  # emitted, without blank/sos/eos
    token_logprobs: list[float]  # log posterior of each emitted token
    encoder_out: Tensor  # (T_row, d)
    alphas: Tensor  # (T_row,): CIF weights after funasr's chunk masking
    fired: Tensor  # (n, d): CIF token embeddings (all fired, before blank/sos/eos are dropped)


class Paraformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        right = args.decoder_fsmn_padding[1]
        if right:
            raise ValueError(
                f"decoder kernel_size {args.decoder_kernel} with sanm_shfit {args.decoder_sanm_shift} is not causal "
                f"(right padding {right}); streaming supports causal decoder FSMN blocks only, as released")
        self.args = args
        self.encoder = Encoder(args)
        self.predictor = CifPredictor(args)
        self.decoder = Decoder(args)

    # -- state ----------------------------------------------------------------------------------

    def new_state(self, chunk: ChunkConfig) -> StreamState:
        p = next(self.parameters())
        return StreamState(
            position=0,
            overlap=torch.zeros(chunk.overlap_frames, self.args.input_dim, dtype=p.dtype, device=p.device),
            encoder_kv=None,
            cif_alpha=torch.zeros((), dtype=p.dtype, device=p.device),
            cif_hidden=torch.zeros(self.args.dim, dtype=p.dtype, device=p.device),
            decoder_context=None,
            decoder_kv=None,
        )

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, feats: list[Tensor | None], finals: list[bool], states: list[StreamState], chunk: ChunkConfig
             ) -> list[ChunkOutput]:
        """One chunk of each of B streams. feats[i] is stream i's new LFR frames (n_i, F), or None
        for funasr's tail chunk (a final piece under 960 samples: the kept overlap frames run again,
        see below); finals[i] marks its utterance's last piece. Updates states in place."""
        enc, valid = self._encode(feats, states, chunk)
        return self._predict_and_decode(enc, valid, finals, states, chunk)

    def _encode(self, feats: list[Tensor | None], states: list[StreamState], chunk: ChunkConfig
                ) -> tuple[Tensor, Tensor]:
        args, scale = self.args, self.encoder.dim ** 0.5
        rows = []
        for x, state in zip(feats, states):
            if x is None:
                # funasr's tail chunk feeds the kept overlap frames as the new input, and its
                # in-place `xs_pad *= sqrt(d)` scales that cached tensor itself: the encoder sees
                # the overlap frames scaled a second time. Kept, to decode as funasr does (the
                # first layer's LayerNorm all but cancels the scale, so it matters little).
                rows.append(state.overlap * scale)
                continue
            n = x.shape[0]
            positions = torch.arange(state.position + 1, state.position + n + 1, device=x.device, dtype=x.dtype)
            x = x * scale + sinusoidal_encoding(positions[None], x.shape[1])[0].to(x.dtype)
            state.position += n
            x = torch.cat((state.overlap, x), dim=0)  # (c0+c2+n, F)
            state.overlap = x[-chunk.overlap_frames:]
            rows.append(x)
        lengths = torch.tensor([r.shape[0] for r in rows])
        x = nn.utils.rnn.pad_sequence(rows, batch_first=True)  # (B, T, F)
        valid = torch.arange(x.shape[1])[None, :] < lengths[:, None]  # (B, T)
        valid = valid.to(x.device)

        layers = self.encoder.layers
        heads, dk = args.encoder_heads, args.dim // args.encoder_heads
        past, past_valid = _stack_kv([s.encoder_kv for s in states], len(layers), heads, dk, x)
        new_k, new_v = [], []
        for i, layer in enumerate(layers):
            x, k_h, v_h = layer(x, valid, past[:, i, 0], past[:, i, 1], past_valid)
            new_k.append(k_h)
            new_v.append(v_h)
        enc = self.encoder.after_norm(x) * valid[..., None]

        look_back = chunk.encoder_look_back
        if look_back != 0:
            # funasr keeps each layer's keys/values except the look-ahead frames (they are
            # recomputed next chunk as part of the overlap): cat(old, k[:-c2]), then the last
            # look_back * c1 frames (the first chunk's are kept whole).
            kv = torch.stack((torch.stack(new_k, 1), torch.stack(new_v, 1)), 2)  # (B, layers, 2, H, T, dk)
            for row, state in enumerate(states):
                fresh = kv[row, :, :, :, : int(lengths[row]) - chunk.chunk_size[2]]
                if state.encoder_kv is None:
                    state.encoder_kv = fresh.clone()
                else:
                    joined = torch.cat((state.encoder_kv, fresh), dim=3)
                    state.encoder_kv = joined if look_back == -1 else joined[:, :, :, -look_back * chunk.stride_frames:]
        return enc, valid

    def _predict_and_decode(self, enc: Tensor, valid: Tensor, finals: list[bool], states: list[StreamState],
                            chunk: ChunkConfig) -> list[ChunkOutput]:
        b, t, d = enc.shape
        c0, c1, _ = chunk.chunk_size
        alphas = self.predictor.weights(enc)  # (B, T)
        # funasr zeroes the left context's weights, and unless final, the look-ahead's.
        keep = valid.clone()
        keep[:, :c0] = False
        not_final = torch.tensor([not f for f in finals], device=enc.device)
        keep[:, c0 + c1:] &= ~not_final[:, None]
        alphas = alphas * keep
        tail = torch.tensor([self.predictor.tail_threshold if f else 0.0 for f in finals], dtype=enc.dtype,
                            device=enc.device)
        carry_alpha = torch.stack([s.cif_alpha for s in states])
        carry_hidden = torch.stack([s.cif_hidden for s in states])
        cif_in = torch.cat((carry_hidden[:, None], enc, enc.new_zeros(b, 1, d)), dim=1)  # (B, T+2, d)
        cif_alphas = torch.cat((carry_alpha[:, None], alphas, tail[:, None]), dim=1)  # (B, T+2)
        fired, new_alpha, new_hidden = self.predictor.fire(cif_in, cif_alphas)
        for row, state in enumerate(states):
            state.cif_alpha, state.cif_hidden = new_alpha[row], new_hidden[row]

        lengths = valid.sum(1).tolist()
        outputs = [ChunkOutput([], [], enc[row, : lengths[row]], alphas[row, : lengths[row]],
                               torch.stack(fired[row]) if fired[row] else enc.new_zeros(0, d))
                   for row in range(b)]
        # Streams that fired nothing skip the decoder, their decoder state untouched (funasr
        # returns before its decoder call when no token fired).
        rows = [row for row in range(b) if fired[row]]
        if rows:
            logp = self._decode(enc[rows], valid[rows], [outputs[r].fired for r in rows], [states[r] for r in rows], chunk)
            for j, row in enumerate(rows):
                best, ids = logp[j, : len(fired[row])].max(-1)
                skip = (self.args.blank_id, self.args.sos, self.args.eos)
                kept = [(i, p) for i, p in zip(ids.tolist(), best.tolist()) if i not in skip]
                outputs[row].token_ids = [i for i, _ in kept]
                outputs[row].token_logprobs = [p for _, p in kept]
        return outputs

    def _decode(self, memory: Tensor, valid: Tensor, embeds: list[Tensor], states: list[StreamState],
                chunk: ChunkConfig) -> Tensor:
        """memory (B, T, d) with valid (B, T); embeds: each row's fired token embeddings (n_i, d).
        Returns log-posteriors (B, N, V)."""
        args = self.args
        n_tokens = [e.shape[0] for e in embeds]
        x = nn.utils.rnn.pad_sequence(embeds, batch_first=True)  # (B, N, d)
        layers = self.decoder.decoders
        context_len = args.decoder_kernel - 1
        contexts = torch.stack([
            s.decoder_context if s.decoder_context is not None else x.new_zeros(len(layers), args.dim, context_len)
            for s in states])  # (B, layers, d, kernel-1)
        heads, dk = args.decoder_heads, args.dim // args.decoder_heads
        look_back = chunk.decoder_look_back
        # funasr's cross-attention look-back: only a positive count keeps keys (-1 keeps none).
        past, past_valid = _stack_kv([s.decoder_kv if look_back > 0 else None for s in states],
                                     len(layers), heads, dk, x)
        new_contexts, new_k, new_v = [], [], []
        for i, layer in enumerate(layers):
            residual = x
            h = layer.feed_forward(layer.norm1(x))
            h_norm = layer.norm2(h)
            x = residual + layer.self_attn(h_norm, contexts[:, i])
            # Next chunk's FSMN left context: the last kernel-1 inputs of each row's real tokens.
            joined = torch.cat((contexts[:, i], h_norm.transpose(1, 2)), dim=2)  # (B, d, kernel-1+N)
            new_contexts.append(torch.stack([joined[r, :, n: n + context_len] for r, n in enumerate(n_tokens)]))
            att, k_h, v_h = layer.src_attn(layer.norm3(x), memory, valid, past[:, i, 0], past[:, i, 1], past_valid)
            x = x + att
            new_k.append(k_h)
            new_v.append(v_h)
        for layer in self.decoder.decoders3:
            x = layer(x)
        logits = self.decoder.output_layer(self.decoder.after_norm(x))

        new_context = torch.stack(new_contexts, 1)  # (B, layers, d, kernel-1)
        kv = torch.stack((torch.stack(new_k, 1), torch.stack(new_v, 1)), 2) if look_back > 0 else None
        lengths = valid.sum(1).tolist()
        for row, state in enumerate(states):
            state.decoder_context = new_context[row].clone()
            if kv is not None:
                # funasr: cat(old, k) over this chunk's encoder frames, keep the last look_back * c1.
                fresh = kv[row, :, :, :, : lengths[row]]
                joined = fresh if state.decoder_kv is None else torch.cat((state.decoder_kv, fresh), dim=3)
                state.decoder_kv = joined[:, :, :, -look_back * chunk.stride_frames:].clone()
        return torch.log_softmax(logits, dim=-1)


def _stack_kv(caches: list[Tensor | None], layers: int, heads: int, dk: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """Rows' key/value caches (layers, 2, H, P_i, dk) or None, left-padded to one tensor
    (B, layers, 2, H, P, dk) with past_valid (B, P)."""
    longest = max((c.shape[3] for c in caches if c is not None), default=0)
    if longest and all(c is not None and c.shape[3] == longest for c in caches):
        # Every row's look-back is full (a running show's steady state): one copy, no padding.
        return torch.stack(caches), torch.ones(len(caches), longest, dtype=torch.bool, device=like.device)
    past = like.new_zeros(len(caches), layers, 2, heads, longest, dk)
    past_valid = torch.zeros(len(caches), longest, dtype=torch.bool, device=like.device)
    for row, cache in enumerate(caches):
        if cache is not None and cache.shape[3]:
            past[row, :, :, :, longest - cache.shape[3]:] = cache
            past_valid[row, longest - cache.shape[3]:] = True
    return past, past_valid
