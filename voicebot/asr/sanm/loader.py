"""Load a FunASR streaming Paraformer directory as released on ModelScope into our model.

    config.yaml  model.pt (or model.safetensors)  tokens.json (or tokens.txt)  am.mvn

config.yaml names FunASR's classes and their sizes; we accept the classes model.py implements and
refuse anything else by name. The checkpoint is matched against our module's key and shape
manifest before a single tensor is assigned: a missing, unexpected or mis-shaped key fails the
load with its name (funasr itself prints a warning and serves random layers). Keys of training
only heads (the CTC branch some checkpoints carry) are the only ones allowed to be left over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from voicebot.asr.sanm.frontend import Cmvn, FrontendConfig, load_cmvn
from voicebot.asr.sanm.model import ModelArgs, Paraformer

# config.yaml's class names this implementation follows (funasr 1.4.16 registry names).
MODEL_CLASSES = {"ParaformerStreaming"}
ENCODER_CLASSES = {"SANMEncoderChunkOpt"}
DECODER_CLASSES = {"ParaformerSANMDecoder"}
PREDICTOR_CLASSES = {"CifPredictorV2"}
FRONTEND_CLASSES = {"WavFrontendOnline", "WavFrontend"}
# Checkpoint keys of training-only modules, not used at inference.
UNUSED_PREFIXES = ("ctc.", "criterion_att.", "criterion_pre.")


class CheckpointMismatch(RuntimeError):
    """The checkpoint does not fit the architecture config.yaml describes."""


@dataclass
class LoadedParaformer:
    model_dir: Path
    model: Paraformer
    frontend: FrontendConfig
    cmvn: Cmvn | None
    tokens: list[str]
    config: dict[str, Any]


def _require(value: object, allowed: set[str], what: str, path: Path) -> None:
    if value not in allowed:
        raise ValueError(f"{path}: {what} {value!r} is not supported (supported: {', '.join(sorted(allowed))})")


def model_args(config: dict[str, Any], vocab_size: int, path: Path = Path("config.yaml")) -> ModelArgs:
    """ModelArgs from a parsed config.yaml; refuses what model.py does not implement."""
    _require(config.get("model"), MODEL_CLASSES, "model", path)
    _require(config.get("encoder"), ENCODER_CLASSES, "encoder", path)
    _require(config.get("decoder"), DECODER_CLASSES, "decoder", path)
    _require(config.get("predictor"), PREDICTOR_CLASSES, "predictor", path)
    enc, dec = config.get("encoder_conf", {}), config.get("decoder_conf", {})
    pred, front = config.get("predictor_conf", {}), config.get("frontend_conf", {})
    model_conf = config.get("model_conf", {})
    checks = {
        "encoder_conf.input_layer": (enc.get("input_layer"), "pe_online"),
        "encoder_conf.selfattention_layer_type": (enc.get("selfattention_layer_type", "sanm"), "sanm"),
        "encoder_conf.normalize_before": (enc.get("normalize_before", True), True),
        "encoder_conf.concat_after": (enc.get("concat_after", False), False),
        "encoder_conf.positionwise_layer_type": (enc.get("positionwise_layer_type", "linear"), "linear"),
        "decoder_conf.normalize_before": (dec.get("normalize_before", True), True),
        "decoder_conf.concat_after": (dec.get("concat_after", False), False),
        # Layers past att_layer_num (decoders2) exist in funasr's class but the released models have none.
        "decoder_conf.att_layer_num": (dec.get("att_layer_num", 6), dec.get("num_blocks", 6)),
    }
    for key, (got, want) in checks.items():
        if got != want:
            raise ValueError(f"{path}: {key} is {got!r}; this implementation needs {want!r}")
    if int(pred.get("idim", enc.get("output_size", 256))) != int(enc.get("output_size", 256)):
        raise ValueError(f"{path}: predictor_conf.idim {pred.get('idim')} != encoder output_size {enc.get('output_size')}")
    return ModelArgs(
        input_dim=int(front.get("n_mels", 80)) * int(front.get("lfr_m", 1)),
        dim=int(enc.get("output_size", 256)),
        encoder_heads=int(enc.get("attention_heads", 4)),
        encoder_ffn=int(enc.get("linear_units", 2048)),
        encoder_layers=int(enc.get("num_blocks", 6)),
        encoder_kernel=int(enc.get("kernel_size", 11)),
        encoder_sanm_shift=int(enc.get("sanm_shfit", 0)),
        decoder_heads=int(dec.get("attention_heads", 4)),
        decoder_ffn=int(dec.get("linear_units", 2048)),
        decoder_layers=int(dec.get("num_blocks", 6)),
        decoder_kernel=int(dec.get("kernel_size", 21)),
        decoder_sanm_shift=int(dec.get("sanm_shfit", 0)),
        vocab_size=vocab_size,
        cif_l_order=int(pred["l_order"]),
        cif_r_order=int(pred["r_order"]),
        cif_threshold=float(pred.get("threshold", 1.0)),
        cif_tail_threshold=float(pred.get("tail_threshold", 0.0)),
        cif_smooth_factor=float(pred.get("smooth_factor", 1.0)),
        cif_noise_threshold=float(pred.get("noise_threshold", 0.0)),
        blank_id=int(model_conf.get("blank_id", 0)),
        sos=int(model_conf.get("sos", 1)),
        eos=int(model_conf.get("eos", 2)),
    )


def frontend_config(config: dict[str, Any], path: Path = Path("config.yaml")) -> FrontendConfig:
    _require(config.get("frontend"), FRONTEND_CLASSES, "frontend", path)
    front = config.get("frontend_conf", {})
    if not front.get("snip_edges", True):
        raise ValueError(f"{path}: frontend_conf.snip_edges false is not supported")
    return FrontendConfig(fs=int(front.get("fs", 16000)), n_mels=int(front.get("n_mels", 80)),
                          frame_length=int(front.get("frame_length", 25)), frame_shift=int(front.get("frame_shift", 10)),
                          lfr_m=int(front.get("lfr_m", 1)), lfr_n=int(front.get("lfr_n", 1)),
                          window=str(front.get("window", "hamming")))


def load_tokens(model_dir: Path) -> list[str]:
    if (model_dir / "tokens.json").exists():
        tokens = json.loads((model_dir / "tokens.json").read_text(encoding="utf-8"))
    elif (model_dir / "tokens.txt").exists():
        tokens = [line.strip() for line in (model_dir / "tokens.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        raise FileNotFoundError(f"{model_dir}: no tokens.json or tokens.txt")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{model_dir}: the token list must be a list of strings")
    return tokens


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, else model.pt (a state dict, or one wrapped as funasr's trainer saves it)."""
    if (model_dir / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(model_dir / "model.safetensors"))
    path = model_dir / "model.pt"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.pt")
    try:  # memory-mapped: an 880 MB checkpoint is not read into a second copy
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # torch's legacy (non-zip) format cannot be mapped
        state = torch.load(path, map_location="cpu", weights_only=True)
    for wrapper in ("state_dict", "model_state_dict", "model"):
        if isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    return {key.removeprefix("module."): value for key, value in state.items()}


def match_manifest(module: nn.Module, state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors for every key of `module`, or CheckpointMismatch naming the keys
    that are missing, unexpected or of another shape."""
    expected = {key: tuple(t.shape) for key, t in module.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(k for k in set(state) - set(expected) if not k.startswith(UNUSED_PREFIXES))
    wrong = sorted(f"{k} (checkpoint {tuple(state[k].shape)}, config.yaml {expected[k]})"
                   for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    problems = [f"missing {k}" for k in missing] + [f"unexpected {k}" for k in unexpected] + [f"shape of {k}" for k in wrong]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointMismatch(f"{source} does not match its config.yaml: {shown}")
    return {key: state[key] for key in expected}


def load_paraformer(model_dir: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> LoadedParaformer:
    model_dir = Path(model_dir)
    config_path = model_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    tokens = load_tokens(model_dir)
    args = model_args(config, len(tokens), config_path)
    frontend = frontend_config(config, config_path)
    cmvn = load_cmvn(model_dir / "am.mvn") if (model_dir / "am.mvn").exists() else None
    if cmvn is None:
        raise FileNotFoundError(f"{model_dir}: no am.mvn (funasr would run without CMVN, silently; we refuse)")
    with torch.device("meta"):
        model = Paraformer(args)
    state = match_manifest(model, read_state_dict(model_dir), model_dir)
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device=device, dtype=dtype).eval()
    return LoadedParaformer(model_dir, model, frontend, cmvn, tokens, config)
