"""CosyVoice 2 language model: a Qwen2 decoder over a static KV cache, plus the speech-token heads.

The Qwen2 part is written out here (gpt-fast style) instead of using transformers: the KV cache is
one preallocated pool with a slot (row) per request, written at explicit positions, so a decode step
always has the same shapes (one token per row against the cache, masked per row) and rows of
different lengths decode in one batch, joining and leaving between steps (lm_pool.py),
or as a CUDA graph. The Qwen text lm_head is never built: CosyVoice reads hidden states through its
own `llm_decoder`.

A request's sequence logic (unistream `generate`, `Bistream`) is written once, as a *program*: a
generator that yields a `Step` (the embeddings to feed and where) and is sent the token chosen from
that step's log-probs; it yields plain ints for the speech tokens it emits. `run_alone` drives one
program at batch 1 (the golden tests, the benchmarks); the LM pool drives many in one batch.

Attention runs on the flash-attn package where it can (CUDA, fp16/bf16, installed), else on torch
SDPA; see `attention_backend`. The flash path reads each row's written prefix (`cache_seqlens`), so
it never touches unwritten slots; SDPA masks them per row.

Module names follow the official Qwen2LM so llm.pt loads strictly (`llm.model.model.layers.N...`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voicebot.tts.cosyvoice2.sampling import Sampler, host_to_device, sample_rows

log = logging.getLogger(__name__)

# Official Qwen2LM.inference defaults; the yaml does not set them.
MIN_TOKEN_TEXT_RATIO = 2.0
MAX_TOKEN_TEXT_RATIO = 20.0
KV_BUCKET = 256  # decode attends over the KV cache in multiples of this many slots
_TEXT_HEAD_KEY = "llm.model.lm_head.weight"
_EMBED_TOKENS_KEY = "llm.model.model.embed_tokens.weight"


@dataclass(frozen=True)
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen2Config:
        """From the fields of a HF Qwen2 config.json."""
        if d.get("hidden_act", "silu") != "silu" or d.get("rope_scaling") or d.get("use_sliding_window"):
            raise ValueError("only plain Qwen2 (silu, unscaled RoPE, no sliding window) is supported")
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen2Config:
        """Read CosyVoice-BlankEN/config.json."""
        return cls.from_hf(json.loads(Path(path).read_text()))


def keys_to_attend(n_written: int, max_seq_len: int) -> int:
    """The cache slots SDPA attends over when the longest row has written `n_written`: that prefix
    rounded up to KV_BUCKET slots, the rest masked. A handful of fixed shapes instead of the whole
    cache, whose unwritten slots cost as much as the step's weights on CPU at 2048 slots."""
    return min(max_seq_len, -(-n_written // KV_BUCKET) * KV_BUCKET)


def attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    """"flash_attn" where flash-attn 2 can run the model's attention (a CUDA device of compute
    capability 8.0 or newer, fp16/bf16, the package importable), else "sdpa"."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "sdpa"
    if torch.cuda.get_device_capability(device) < (8, 0):  # flash-attn 2 refuses older GPUs at the first call
        return "sdpa"
    try:
        import flash_attn
    except Exception as exc:  # a broken install (e.g. built for another torch) must not stop the model loading
        if not (isinstance(exc, ModuleNotFoundError) and exc.name == "flash_attn"):  # not merely absent
            log.warning("flash_attn does not import (%s: %s); attention runs on torch SDPA", type(exc).__name__, exc)
        return "sdpa"
    return "flash_attn" if hasattr(flash_attn, "flash_attn_with_kvcache") else "sdpa"


class KVCache:
    """Keys and values of `batch` slots: [layers, slots, kv_heads, max_seq_len, head_dim], written by
    position. One slot is one request's whole context; a pool of them serves many requests at once."""

    def __init__(self, cfg: Qwen2Config, max_seq_len: int, batch: int = 1,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"KV cache length {max_seq_len} > max_position_embeddings {cfg.max_position_embeddings}")
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class Linear(nn.Linear):
    """nn.Linear whose calls on more than one row can multiply a oneDNN-prepacked copy of the weight
    (CPU, fp32), once `prepack()` has made one.

    torch's CPU GEMM (MKL) packs the weight into its blocked layout on every call. For the few rows of
    a batched decode step that repacking costs as much as the multiply itself (released LM, one core:
    the 4864 x 896 gate projection at 16 rows takes 5.1 ms dense, 2.1 ms prepacked). A single row stays
    on the dense weight, whose GEMV reads it as it lies (1.0 ms, against 1.4 ms prepacked). So the copy
    is a second one, as large as the weight: 1.43 GB for the released LM's linear layers in fp32.
    The state dict holds only the dense weight; the copy is remade when the weight is replaced or
    written (loading, `.to()`, a layout change) and not used off CPU, off fp32 or under torch.compile.
    """

    _packed: tuple[Tensor, tuple] | None = None  # (the prepacked weight, the weight it was made from)

    def prepack(self) -> None:
        if self._packed is None or self._packed[1] != self._weight_key():
            self._packed = (self._pack(), self._weight_key()) if self._packable() else None

    def packed_nbytes(self) -> int:
        return 0 if self._packed is None else self.weight.numel() * self.weight.element_size()

    def forward(self, x: Tensor) -> Tensor:
        # Under torch.compile the dense weight: inductor picks its own kernel (and with freezing
        # prepacks the weight itself); its graphs cannot hold a oneDNN tensor.
        if self._packed is not None and x.numel() > x.shape[-1] and not torch.compiler.is_compiling():
            if self._packed[1] != self._weight_key():
                self.prepack()
            if self._packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self._packed[0], self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _packable(self) -> bool:
        w = self.weight
        return w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()

    def _pack(self) -> Tensor:
        with torch.inference_mode(False), torch.no_grad():  # usable in and out of inference mode
            return torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def _weight_key(self) -> tuple:
        w = self.weight
        return w.data_ptr(), w._version, w.device, w.dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics even when the model runs in fp16, as HF Qwen2 does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(input_pos: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(..., T) positions -> cos, sin (..., T, head_dim), rotate-half layout. Computed per call: it is
    tiny and keeps the model free of buffers that would have to be rebuilt after a meta-device load."""
    exponent = torch.arange(0, head_dim, 2, device=input_pos.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / theta**exponent
    freqs = input_pos.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, H, T, hd); cos/sin: (B, 1, T, hd), one row of positions per batch row
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=True)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=True)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=True)
        self.o_proj = Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, n_keys: int, pos: Tensor,
                slots: Tensor | None, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        # x: (B, T, D), row b at positions pos[b] (B, T), consecutive, stored in cache slot slots[b]
        # (rows 0..B-1 when None); k_cache/v_cache: (slots, n_kv, S, hd), updated in place.
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rows = torch.arange(B, device=x.device) if slots is None else slots
        if mask is None:
            # Optional dependency, importable since Qwen2.attention chose it.
            from flash_attn import flash_attn_with_kvcache

            # flash-attn takes (B, S, heads, hd) views of our layout as they are (it only needs hd
            # contiguous), shares kv heads itself and appends k/v to each row's cache at
            # cache_seqlens[b] = pos[b, 0]; causal aligns each row's queries bottom-right, so query
            # t sees keys up to its own position pos[b, t].
            y = flash_attn_with_kvcache(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                        k.transpose(1, 2), v.transpose(1, 2),
                                        cache_seqlens=pos[:, 0].to(torch.int32),
                                        cache_batch_idx=rows.to(torch.int32), causal=True)
        else:
            # Index assignment with (B, 1) rows and (B, T) positions around a slice: the target is
            # (B, T, n_kv, hd), every row written at its own positions in one kernel.
            k_cache[rows[:, None], :, pos] = k.transpose(1, 2)
            v_cache[rows[:, None], :, pos] = v.transpose(1, 2)
            keys = k_cache[:B, :, :n_keys] if slots is None else k_cache[slots, :, :n_keys]  # a view, or a gather
            values = v_cache[:B, :, :n_keys] if slots is None else v_cache[slots, :, :n_keys]
            # The query heads sharing a kv head attend as one longer query, (B, n_kv, group·T, hd):
            # one pass over each kv head's keys instead of enable_gqa's one per query head (a
            # 16-row decode step's attention on CPU: 0.56 ms a layer instead of 1.5).
            grouped = q.reshape(B, self.n_kv, -1, self.head_dim)
            y = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
            y = y.view(B, self.n_head, T, self.head_dim).transpose(1, 2)
        return self.o_proj(y.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, n_keys: int, pos: Tensor,
                slots: Tensor | None, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, n_keys, pos, slots, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2(nn.Module):
    """Qwen2 decoder without its text head: embeddings in, final-norm hidden states out."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._attention: tuple[torch.device, torch.dtype, str] | None = None  # see `attention`

    @property
    def attention(self) -> str:
        """The attention kernel forward runs, "flash_attn" or "sdpa" (`attention_backend`), chosen
        for where the weights are now: moving the model to another device or dtype chooses again."""
        w = self.embed_tokens.weight
        if self._attention is None or self._attention[:2] != (w.device, w.dtype):
            self._attention = (w.device, w.dtype, attention_backend(w.device, w.dtype))
        return self._attention[2]

    def forward(self, x: Tensor, input_pos: Tensor, cache: KVCache, slots: Tensor | None = None,
                n_keys: int | None = None) -> Tensor:
        """x (B, T, D) -> (B, T, D) after the final norm. input_pos: (T,) positions shared by every
        row, or (B, T) per row (rows at different lengths); each row's T positions are consecutive.
        slots: (B,) the cache slots the rows live in, default 0..B-1. n_keys: how many cache slots
        SDPA attends over, default the written prefix in KV_BUCKET steps (a fixed value keeps the
        step free of host syncs, for CUDA graphs)."""
        B = x.shape[0]
        pos = input_pos.expand(B, -1) if input_pos.ndim == 1 else input_pos
        cos, sin = (t[:, None] for t in rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, x.dtype))
        if self.attention == "flash_attn":
            mask = None  # flash-attn masks per row itself, from cache_seqlens
        else:
            if n_keys is None:  # callers that know their positions pass n_keys: no host sync
                n_keys = keys_to_attend(int(pos.max()) + 1, cache.max_seq_len)
            # (B, 1, group·T, n_keys): each row's query t sees the keys up to its own position, the
            # same for each of the query heads that Attention groups per kv head.
            group = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
            mask = (torch.arange(n_keys, device=x.device) <= pos[:, :, None])[:, None].repeat(1, 1, group, 1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, n_keys, pos, slots, cache.k[i], cache.v[i])
        return self.norm(x)


class CosyVoice2LM(nn.Module):
    """Official Qwen2LM at inference: [sos | text | task_id | speech] -> speech-token logits."""

    def __init__(self, cfg: Qwen2Config, speech_token_size: int, mix_ratio: Sequence[int] = (5, 15)) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.speech_token_size = speech_token_size
        self.eos = speech_token_size
        self.fill_token = speech_token_size + 2
        self.stop_tokens = frozenset({speech_token_size, speech_token_size + 1, speech_token_size + 2})
        self.mix_ratio = tuple(mix_ratio)
        self.llm_embedding = nn.Embedding(2, d)  # row 0 = sos, row 1 = task_id
        # `llm.model.model` mirrors Qwen2Encoder -> Qwen2ForCausalLM -> Qwen2Model for the key names.
        self.llm = nn.Module()
        self.llm.model = nn.Module()
        self.llm.model.model = Qwen2(cfg)
        self.llm_decoder = Linear(d, speech_token_size + 3)
        self.speech_embedding = nn.Embedding(speech_token_size + 3, d)
        self._register_load_state_dict_pre_hook(self._drop_text_head)
        self._register_state_dict_hook(self._tie_text_head)

    @property
    def qwen(self) -> Qwen2:
        return self.llm.model.model

    @property
    def cfg(self) -> Qwen2Config:
        return self.qwen.cfg

    @property
    def attention(self) -> str:
        """"flash_attn" or "sdpa": the attention kernel the model runs where it is now."""
        return self.qwen.attention

    # The checkpoint carries the tied Qwen text head; it is never computed, so it is not a module here.
    @staticmethod
    def _drop_text_head(state_dict: dict, prefix: str, *args: Any) -> None:
        state_dict.pop(prefix + _TEXT_HEAD_KEY, None)

    @staticmethod
    def _tie_text_head(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        state_dict[prefix + _TEXT_HEAD_KEY] = state_dict[prefix + _EMBED_TOKENS_KEY]

    def prepack(self) -> int:
        """Give every linear layer a prepacked weight for its calls on many rows (`Linear`): the
        bytes that adds (none off CPU or off fp32)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for linear in linears:
            linear.prepack()
        return sum(linear.packed_nbytes() for linear in linears)

    def new_cache(self, max_seq_len: int, batch: int = 1) -> KVCache:
        p = self.llm_decoder.weight
        return KVCache(self.cfg, max_seq_len, batch, p.device, p.dtype)

    def embed_text(self, ids: Tensor) -> Tensor:
        return self.qwen.embed_tokens(ids.reshape(1, -1).long())  # (1, N, D)

    def embed_speech(self, ids: Tensor) -> Tensor:
        return self.speech_embedding(ids.reshape(1, -1).long())  # (1, N, D)

    def sos_task(self) -> tuple[Tensor, Tensor]:
        w = self.llm_embedding.weight
        return w[0].reshape(1, 1, -1), w[1].reshape(1, 1, -1)

    def forward(self, x: Tensor, input_pos: Tensor, cache: KVCache, slots: Tensor | None = None,
                n_keys: int | None = None) -> Tensor:
        """(B, T, D) inputs at positions input_pos (see Qwen2.forward) -> log-probs of each row's
        next speech token (B, V), float32."""
        h = self.qwen(x, input_pos, cache, slots, n_keys)
        return self.logp(h[:, -1])

    def logp(self, hidden: Tensor) -> Tensor:
        """(B, D) last hidden states -> (B, V) float32 log-probs."""
        return self.llm_decoder(hidden).float().log_softmax(-1)


def token_ids(ids: Tensor | Sequence[int] | None, device: torch.device) -> Tensor:
    """Any id container ((1, N) or (N,) tensor, list, None) -> (N,) long tensor."""
    return torch.as_tensor([] if ids is None else ids, dtype=torch.long, device=device).reshape(-1)


def build_lm_input(lm: CosyVoice2LM, text: Tensor, prompt_text: Tensor, prompt_speech: Tensor) -> Tensor:
    """Spec §6.1: [sos | embed_tokens(prompt_text ++ text) | task_id | speech_embedding(prompt_speech)].
    Cross-lingual and SFT pass empty prompts; instruct2 passes the instruction as prompt_text."""
    sos, task_id = lm.sos_task()
    text_emb = lm.embed_text(torch.cat([prompt_text, text]))
    return torch.cat([sos, text_emb, task_id, lm.embed_speech(prompt_speech)], dim=1)  # (1, L, D)


@dataclass(frozen=True)
class PromptPrefix:
    """A voice's reusable LM state: the keys/values of [sos | prompt_text], the leading part of every
    request's input (spec §6.1: the reply text comes after the prompt text, so nothing else is)."""

    prompt_text: Tensor  # (n,) long: the ids it was computed for
    k: Tensor  # (layers, 1, kv_heads, 1 + n, head_dim)
    v: Tensor

    @property
    def length(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@torch.inference_mode()
def prompt_prefix(lm: CosyVoice2LM, prompt_text: Tensor | Sequence[int] | None) -> PromptPrefix:
    ids = token_ids(prompt_text, lm.llm_decoder.weight.device)
    x = torch.cat([lm.sos_task()[0], lm.embed_text(ids)], dim=1)  # (1, 1 + n, D)
    cache = lm.new_cache(x.shape[1])
    lm.qwen(x, torch.arange(x.shape[1], device=x.device), cache)
    return PromptPrefix(ids, cache.k, cache.v)


@dataclass
class Step:
    """What a program asks of the LM next: feed `x` (1, T, D) at cache positions pos .. pos+T-1,
    then choose the next token from the last position's log-probs: `forced` if set (the forward
    still writes the cache), else drawn by the request's sampler with `banned` ids masked, the
    sampler seeing `history`."""

    x: Tensor
    pos: int
    history: Sequence[int]
    banned: tuple[int, ...] = ()
    forced: int | None = None
    length: int = field(init=False)

    def __post_init__(self) -> None:
        self.length = self.x.shape[1]


# Yields Steps (each answered with the chosen token by send()) and the speech tokens it emits (ints,
# answered by next()); ends when the request is done or, in bistream, until more text arrives.
Program = Generator["Step | int", "int | None", None]


def choose(steps: Sequence[Step], logp: Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """The tokens a batch's log-probs (B, V) give, one row per step: its `forced` token, else drawn
    by its sampler with its `banned` ids masked (in place), all rows in one `sample_rows` call."""
    drawn = [i for i, step in enumerate(steps) if step.forced is None]
    banned = [(i, token) for i in drawn for token in steps[i].banned]
    if banned:  # one indexed write for the whole batch, its indices copied without a host wait
        logp.index_put_(tuple(host_to_device(list(zip(*banned)), logp.device)), torch.full((), -float("inf"), device=logp.device))
    tokens = [step.forced for step in steps]
    if drawn:
        rows = logp if len(drawn) == len(steps) else logp[host_to_device(drawn, logp.device)]
        for i, token in zip(drawn, sample_rows([samplers[i] for i in drawn], rows, [steps[i].history for i in drawn])):
            tokens[i] = token
    return tokens  # type: ignore[return-value]


@torch.inference_mode()
def run_alone(lm: CosyVoice2LM, cache: KVCache, sample: Sampler, program: Program) -> Iterator[int]:
    """Drive one program at batch 1 in `cache` (slot 0): the speech tokens it emits."""
    device = lm.llm_decoder.weight.device
    try:
        message = next(program)
        while True:
            if isinstance(message, Step):
                end = message.pos + message.length
                pos = torch.arange(message.pos, end, device=device)
                logp = lm(message.x, pos, cache, n_keys=keys_to_attend(end, cache.max_seq_len))
                message = program.send(choose([message], logp, [sample])[0])
            else:
                yield message
                message = next(program)
    except StopIteration:
        return


def load_prefix(cache: KVCache, prefix: PromptPrefix, slot: int = 0) -> None:
    """Copy a voice's prompt prefix into a cache slot (instead of prefilling it)."""
    cache.k[:, slot : slot + 1, :, : prefix.length] = prefix.k
    cache.v[:, slot : slot + 1, :, : prefix.length] = prefix.v


@torch.inference_mode()
def unistream(lm: CosyVoice2LM, max_seq_len: int, text: Tensor | Sequence[int],
              prompt_text: Tensor | Sequence[int] | None = None,
              prompt_speech: Tensor | Sequence[int] | None = None,
              min_token_text_ratio: float = MIN_TOKEN_TEXT_RATIO,
              max_token_text_ratio: float = MAX_TOKEN_TEXT_RATIO,
              prefix: PromptPrefix | None = None) -> Program:
    """The program of official Qwen2LM.inference (unistream), in a cache slot of max_seq_len positions.

    Limits count only the tts text: at least int(n·min_ratio) tokens (eos alone is masked until
    then), at most int(n·max_ratio), and never past the end of the slot. A `prefix` (the voice's
    `prompt_prefix` for this prompt_text) must already be in the slot (`load_prefix`): its
    positions are not fed again.
    """
    device = lm.llm_decoder.weight.device
    text, prompt_text, prompt_speech = (token_ids(t, device) for t in (text, prompt_text, prompt_speech))
    x = build_lm_input(lm, text, prompt_text, prompt_speech)
    min_len = int(len(text) * min_token_text_ratio)
    max_len = min(int(len(text) * max_token_text_ratio), max_seq_len - x.shape[1] + 1)
    if max_len < min_len:
        raise ValueError(f"KV cache of {max_seq_len} cannot hold a {x.shape[1]}-token prefix "
                         f"plus {min_len} speech tokens; split the text")
    pos = 0
    if prefix is not None:
        if not torch.equal(prefix.prompt_text, prompt_text):
            raise ValueError("the LM prompt prefix was computed for another prompt text")
        x, pos = x[:, prefix.length :], prefix.length
    out: list[int] = []
    for i in range(max_len):
        token = yield Step(x, pos, out, banned=(lm.eos,) if i < min_len else ())
        if token in lm.stop_tokens:
            return
        yield token
        out.append(token)
        pos += x.shape[1]
        x = lm.speech_embedding.weight[token].reshape(1, 1, -1)


def generate(lm: CosyVoice2LM, cache: KVCache, sample: Sampler, text: Tensor | Sequence[int],
             prompt_text: Tensor | Sequence[int] | None = None,
             prompt_speech: Tensor | Sequence[int] | None = None,
             min_token_text_ratio: float = MIN_TOKEN_TEXT_RATIO,
             max_token_text_ratio: float = MAX_TOKEN_TEXT_RATIO,
             prefix: PromptPrefix | None = None) -> Iterator[int]:
    """Decode speech tokens one at a time at batch 1 (`unistream`, run alone in slot 0 of `cache`);
    a `prefix` is copied into the cache first."""
    program = unistream(lm, cache.max_seq_len, text, prompt_text, prompt_speech, min_token_text_ratio,
                        max_token_text_ratio, prefix)
    if prefix is not None:
        load_prefix(cache, prefix)
    return run_alone(lm, cache, sample, program)


def build_lm(hparams: dict[str, Any]) -> CosyVoice2LM:
    """From load_hparams(): Qwen2 geometry from <qwen_pretrain_path>/config.json, the rest from `llm:`."""
    h = hparams["llm"]
    cfg = Qwen2Config.from_json(Path(h["llm"]["pretrain_path"]) / "config.json")
    if not h["llm_input_size"] == h["llm_output_size"] == cfg.hidden_size:
        raise ValueError(f"llm_input_size/llm_output_size {h['llm_input_size']}/{h['llm_output_size']} "
                         f"!= Qwen2 hidden_size {cfg.hidden_size}")
    return CosyVoice2LM(cfg, h["speech_token_size"], h["mix_ratio"])
