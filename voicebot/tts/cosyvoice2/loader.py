"""Load a CosyVoice 2 model directory laid out like the official release.

    cosyvoice2.yaml  llm.pt  flow.pt  hift.pt  spk2info.pt  CosyVoice-BlankEN/{config.json, tokenizer}
    campplus.onnx  speech_tokenizer_v2.onnx   (used by the frontend)

Hyper-parameters come from cosyvoice2.yaml (hparams.py), the Qwen2 geometry from
CosyVoice-BlankEN/config.json; the checkpoints load strictly with weights_only=True.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from voicebot.models import COSYVOICE2_FILES, ModelRef, resolve
from voicebot.tts.cosyvoice2.flow import Flow, build_flow
from voicebot.tts.cosyvoice2.hift import HiFT, build_hift
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, build_lm

# HiFT checkpoints spell weight norm either way; torch's old and new weight_norm APIs.
_WEIGHT_NORM_SPELLINGS = ((".weight_g", ".parametrizations.weight.original0"),
                          (".weight_v", ".parametrizations.weight.original1"))


def resolve_model_dir(model: str, cache_dir: str | Path, config_key: str) -> Path:
    """`model` (a local model directory or a ModelScope id, e.g. iic/CosyVoice2-0.5B) as a local
    directory, by the one resolver of every engine (voicebot/models.py): never downloads."""
    return resolve(ModelRef(config_key, model, Path(cache_dir).expanduser(), COSYVOICE2_FILES))


def _align_weight_norm_keys(state: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """Rename weight-norm keys to the spelling the module uses, whichever the checkpoint has."""
    out = {}
    for key, value in state.items():
        if key not in expected:
            for a, b in _WEIGHT_NORM_SPELLINGS:
                for src, dst in ((a, b), (b, a)):
                    if key.endswith(src) and key[: -len(src)] + dst in expected:
                        key = key[: -len(src)] + dst
        out[key] = value
    return out


def load_checkpoint(module: nn.Module, path: str | Path, strip: str = "") -> None:
    """Load a torch.save'd state dict into `module`, strictly.

    `strip` is removed from every key (hift.pt: "generator.", so a HiFiGan training checkpoint loads
    too). Weight-norm keys are accepted in both spellings. A module built on the meta device gets
    the loaded tensors themselves (memory-mapped from the file, so no second copy is made).
    """
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if strip:
        state = {key.replace(strip, ""): value for key, value in state.items()}
    state = _align_weight_norm_keys(state, set(module.state_dict()))
    is_meta = any(p.is_meta for p in module.parameters())
    module.load_state_dict(state, strict=True, assign=is_meta)


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" is CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None or "auto": float16 on CUDA, float32 elsewhere; otherwise a torch dtype or its name."""
    if dtype is None or dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def cpu_weight_layout(module: nn.Module) -> nn.Module:
    """Store each CPU Linear weight column-major: the same (out, in) tensor, laid out as its (in, out)
    transpose made contiguous, so x @ weightᵀ runs as a plain GEMM/GEMV over contiguous rows.

    torch's CPU BLAS is markedly faster that way on this machine (2 threads, bench/cosyvoice2.py):
    the LM's decode-step GEMVs read their weights at 17.7 GB/s instead of 12.8, prefill GEMMs run at
    122 GFLOP/s instead of 86, the flow's (200 × 256 × 1024) at 101 instead of 77. Values, shapes
    and state-dict keys are unchanged.
    """
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.weight.device.type == "cpu":
            m.weight.data = m.weight.data.t().contiguous().t()
    return module


def _load(build: Callable[[], nn.Module], path: Path, strip: str = "") -> nn.Module:
    # Built on the meta device and given the file's tensors: no random init of weights that are
    # overwritten anyway (2 GB for the LM).
    with torch.device("meta"):
        module = build()
    load_checkpoint(module, path, strip)
    return module.eval()


def load_lm(model_dir: str | Path, hparams: dict[str, Any] | None = None,
            device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None) -> CosyVoice2LM:
    """Build the LM from the yaml and load llm.pt."""
    device = resolve_device(device)
    hparams = hparams or load_hparams(model_dir)
    lm = _load(lambda: build_lm(hparams), Path(model_dir) / "llm.pt")
    return cpu_weight_layout(lm.to(device=device, dtype=resolve_dtype(dtype, device)))


@dataclass
class CosyVoice2Modules:
    model_dir: Path
    hparams: dict[str, Any]
    lm: CosyVoice2LM
    flow: Flow
    hift: HiFT
    device: torch.device
    dtype: torch.dtype  # of the LM and the flow; HiFT always runs in float32, as the official code


def load_cosyvoice2(model_dir: str | Path, device: str | torch.device = "cpu",
                    dtype: str | torch.dtype | None = None) -> CosyVoice2Modules:
    """The LM, flow and HiFT of a model directory on `device` (fp32 on CPU, fp16 on CUDA unless
    `dtype` says otherwise)."""
    model_dir, device = Path(model_dir), resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    hparams = load_hparams(model_dir)
    lm = load_lm(model_dir, hparams, device, dtype)
    flow = _load(lambda: build_flow(hparams["flow"]), model_dir / "flow.pt").to(device=device, dtype=dtype)
    hift = _load(lambda: build_hift(hparams["hift"]), model_dir / "hift.pt", strip="generator.").to(device)
    flow, hift = cpu_weight_layout(flow), cpu_weight_layout(hift)
    return CosyVoice2Modules(model_dir, hparams, lm, flow, hift, device, dtype)
