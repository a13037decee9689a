"""The LM's attention backend: which one is chosen, and that the flash-attn path computes what the
SDPA path does. No GPU or flash-attn here: the package is replaced by a plain-torch `flash_attn_func`
with its documented semantics, so what is checked is our layout, GQA and causal alignment."""

from __future__ import annotations

import builtins
import logging
import sys
import types
from collections.abc import Iterator

import pytest
import torch

from voicebot.tts.cosyvoice2 import lm as lm_module
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, Qwen2Config, attention_backend, generate, prompt_prefix

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def _flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                             cache_seqlens: torch.Tensor | None = None, cache_batch_idx: torch.Tensor | None = None,
                             softmax_scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """flash-attn 2's flash_attn_with_kvcache: q (B, T, H, D), caches (B_cache, S, H_kv, D) updated in
    place with k/v (B, T, H_kv, D) at cache_seqlens[b] in row cache_batch_idx[b]; query head h reads kv
    head h // (H / H_kv); causal aligned bottom-right, query t of row b seeing keys up to seqlens[b] + t."""
    assert all(t.stride(-1) == 1 for t in (q, k_cache, v_cache, k, v)), "flash-attn needs the head dim contiguous"
    assert cache_seqlens.dtype == cache_batch_idx.dtype == torch.int32
    B, T, H, D = q.shape
    out = []
    for b in range(B):
        row, start = int(cache_batch_idx[b]), int(cache_seqlens[b])
        k_cache[row, start : start + T], v_cache[row, start : start + T] = k[b], v[b]
        keys, values = k_cache[row, : start + T], v_cache[row, : start + T]  # (S, H_kv, D)
        group = H // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[b], keys) * (softmax_scale or D**-0.5)
        if causal:
            visible = torch.arange(start + T)[None, :] <= torch.arange(T)[:, None] + start
            scores = scores.masked_fill(~visible, -float("inf"))
        out.append(torch.einsum("hts,shd->thd", scores.softmax(-1), values))
    return torch.stack(out)


@pytest.fixture
def flash_attn(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """An importable flash_attn and an Ampere-or-newer GPU, as far as attention_backend can tell."""
    module = types.ModuleType("flash_attn")
    module.flash_attn_with_kvcache = _flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return module


# --- choosing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_on_cuda_in_half_precision_when_it_imports(flash_attn: types.ModuleType,
                                                               dtype: torch.dtype) -> None:
    assert attention_backend(CUDA, dtype) == "flash_attn"


@pytest.mark.parametrize(("device", "dtype"), [(CUDA, torch.float32), (CPU, torch.float16), (CPU, torch.float32)])
def test_sdpa_off_cuda_or_in_fp32_even_when_flash_attn_imports(flash_attn: types.ModuleType, device: torch.device,
                                                               dtype: torch.dtype) -> None:
    assert attention_backend(device, dtype) == "sdpa"


def test_sdpa_on_gpus_older_than_ampere(flash_attn: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert attention_backend(CUDA, torch.float16) == "sdpa"


def test_sdpa_without_flash_attn_with_kvcache(flash_attn: types.ModuleType) -> None:
    del flash_attn.flash_attn_with_kvcache  # some other package of that name, or a flash-attn 1
    assert attention_backend(CUDA, torch.float16) == "sdpa"


def test_sdpa_quietly_when_flash_attn_is_not_installed(flash_attn: types.ModuleType,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ModuleNotFoundError
    with caplog.at_level(logging.WARNING, logger=lm_module.__name__):
        assert attention_backend(CUDA, torch.float16) == "sdpa"
    assert not caplog.records


@pytest.mark.parametrize("error", [ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice"),
                                   ModuleNotFoundError("No module named 'einops'", name="einops"),
                                   RuntimeError("CUDA driver too old")])
def test_sdpa_with_a_warning_when_flash_attn_is_broken(flash_attn: types.ModuleType, error: Exception,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delitem(sys.modules, "flash_attn")
    real_import = builtins.__import__

    def failing_import(name: str, *args: object, **kwargs: object) -> object:
        if name == "flash_attn":
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    with caplog.at_level(logging.WARNING, logger=lm_module.__name__):
        assert attention_backend(CUDA, torch.float16) == "sdpa"
    (record,) = caplog.records
    assert type(error).__name__ in record.getMessage() and str(error) in record.getMessage()


# --- the model's choice


def _tiny_lm(backend: str | None = None) -> CosyVoice2LM:
    """Seeded, so every call builds the same weights; 4 query heads over 2 kv heads to exercise GQA.
    A `backend` is forced by being the answer to the model's one attention_backend question."""
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4, rms_norm_eps=1e-6,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    lm = CosyVoice2LM(cfg, speech_token_size=16).eval()
    if backend is not None:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(lm_module, "attention_backend", lambda device, dtype: backend)
            assert lm.attention == backend
    return lm


def test_the_model_chooses_once_per_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[torch.device, torch.dtype]] = []

    def backend(device: torch.device, dtype: torch.dtype) -> str:
        asked.append((device, dtype))
        return "sdpa"

    monkeypatch.setattr(lm_module, "attention_backend", backend)
    lm = _tiny_lm()
    assert lm.attention == lm.attention == "sdpa"
    lm.to(torch.float64)
    assert lm.attention == "sdpa"
    assert asked == [(CPU, torch.float32), (CPU, torch.float64)]


# --- the flash path against SDPA


@pytest.fixture
def lms(flash_attn: types.ModuleType) -> Iterator[dict[str, CosyVoice2LM]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # for matmuls this small, more threads only contend (50x slower on a busy machine)
    yield {backend: _tiny_lm(backend) for backend in ("sdpa", "flash_attn")}
    torch.set_num_threads(threads)


def _steps(lm: CosyVoice2LM, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Hidden states of a prefill from 0, a prefill after that prefix, then single-token decode steps;
    and the keys they leave in the cache."""
    cache = lm.new_cache(40)  # under one KV_BUCKET: SDPA masks unwritten slots, flash never reads them
    spans = [(0, 5), (5, 9), *((i, i + 1) for i in range(9, x.shape[1]))]
    with torch.inference_mode():
        out = [lm.qwen(x[:, a:b], torch.arange(a, b), cache) for a, b in spans]
    return out, cache.k


def test_flash_path_equals_sdpa_in_prefill_and_decode(lms: dict[str, CosyVoice2LM]) -> None:
    x = torch.randn(1, 13, 32)
    (sdpa, sdpa_k), (flash, flash_k) = _steps(lms["sdpa"], x), _steps(lms["flash_attn"], x)
    for a, b in zip(sdpa, flash, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    torch.testing.assert_close(flash_k, sdpa_k, atol=1e-5, rtol=0)


def test_flash_path_generates_what_sdpa_does_from_a_copied_prompt_prefix(lms: dict[str, CosyVoice2LM]) -> None:
    def run(lm: CosyVoice2LM) -> list[torch.Tensor]:
        steps: list[torch.Tensor] = []

        def best_speech_token(logp: torch.Tensor, history: list[int]) -> int:  # never stops: 12 steps
            steps.append(logp.clone())
            return int(logp[: lm.speech_token_size].argmax())

        prompt_text = [3, 4, 5]
        list(generate(lm, lm.new_cache(48), best_speech_token, [6, 7, 8], prompt_text, [1, 2],
                      min_token_text_ratio=2, max_token_text_ratio=4, prefix=prompt_prefix(lm, prompt_text)))
        return steps

    sdpa, flash = run(lms["sdpa"]), run(lms["flash_attn"])
    assert len(sdpa) == 12
    torch.testing.assert_close(torch.stack(flash), torch.stack(sdpa), atol=1e-5, rtol=0)


def test_flash_path_equals_sdpa_for_rows_at_different_lengths_in_any_slots(lms: dict[str, CosyVoice2LM]) -> None:
    """A batched decode step: three rows at positions 4, 9 and 6, living in slots 3, 0 and 2 of the pool."""
    lengths, slots = [4, 9, 6], torch.tensor([3, 0, 2])
    prefixes = [torch.randn(1, n, 32) for n in lengths]
    step = torch.randn(3, 1, 32)

    def run(lm: CosyVoice2LM) -> tuple[torch.Tensor, torch.Tensor]:
        cache = lm.new_cache(40, batch=4)
        with torch.inference_mode():
            for x, slot in zip(prefixes, slots):
                lm.qwen(x, torch.arange(x.shape[1]), cache, slots=slot.reshape(1))
            return lm.qwen(step, torch.tensor(lengths)[:, None], cache, slots=slots), cache.k

    (sdpa, sdpa_k), (flash, flash_k) = run(lms["sdpa"]), run(lms["flash_attn"])
    torch.testing.assert_close(flash, sdpa, atol=1e-5, rtol=0)
    torch.testing.assert_close(flash_k, sdpa_k, atol=1e-5, rtol=0)
    # and each row is what that row alone computes
    for i, (x, n) in enumerate(zip(prefixes, lengths)):
        cache = lms["sdpa"].new_cache(40)
        with torch.inference_mode():
            lms["sdpa"].qwen(x, torch.arange(n), cache)
            alone = lms["sdpa"].qwen(step[i : i + 1], torch.tensor([n]), cache)
        torch.testing.assert_close(sdpa[i : i + 1], alone, atol=1e-6, rtol=0)
