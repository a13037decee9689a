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

# What config.yaml must say for model.py to implement it: dotted key -> the values accepted (funasr
# 1.4.16's registry names and options). An absent key is read as funasr's default (DEFAULTS).
SUPPORTED: dict[str, tuple[object, ...]] = {
    "model": ("ParaformerStreaming",),
    "encoder": ("SANMEncoderChunkOpt",),
    "decoder": ("ParaformerSANMDecoder",),
    "predictor": ("CifPredictorV2",),
    "frontend": ("WavFrontendOnline", "WavFrontend"),
    "encoder_conf.input_layer": ("pe_online",),
    "encoder_conf.selfattention_layer_type": ("sanm",),
    "encoder_conf.normalize_before": (True,),
    "encoder_conf.concat_after": (False,),
    "encoder_conf.positionwise_layer_type": ("linear",),
    "decoder_conf.normalize_before": (True,),
    "decoder_conf.concat_after": (False,),
    "frontend_conf.snip_edges": (True,),
}
# Keys that must equal another key. Decoder layers past att_layer_num (decoders2) exist in funasr's
# class but the released models have none; the predictor reads the encoder's output.
SAME_AS = {"decoder_conf.att_layer_num": "decoder_conf.num_blocks", "predictor_conf.idim": "encoder_conf.output_size"}
# funasr's defaults for the keys a config.yaml may leave out.
DEFAULTS: dict[str, object] = {
    "encoder_conf.selfattention_layer_type": "sanm", "encoder_conf.normalize_before": True,
    "encoder_conf.concat_after": False, "encoder_conf.positionwise_layer_type": "linear",
    "encoder_conf.output_size": 256, "encoder_conf.attention_heads": 4, "encoder_conf.linear_units": 2048,
    "encoder_conf.num_blocks": 6, "encoder_conf.kernel_size": 11, "encoder_conf.sanm_shfit": 0,
    "decoder_conf.normalize_before": True, "decoder_conf.concat_after": False, "decoder_conf.attention_heads": 4,
    "decoder_conf.linear_units": 2048, "decoder_conf.num_blocks": 6, "decoder_conf.att_layer_num": 6,
    "decoder_conf.kernel_size": 21, "decoder_conf.sanm_shfit": 0,
    "predictor_conf.threshold": 1.0, "predictor_conf.tail_threshold": 0.0, "predictor_conf.smooth_factor": 1.0,
    "predictor_conf.noise_threshold": 0.0,
    "model_conf.blank_id": 0, "model_conf.sos": 1, "model_conf.eos": 2,
    "frontend_conf.snip_edges": True, "frontend_conf.fs": 16000, "frontend_conf.n_mels": 80,
    "frontend_conf.frame_length": 25, "frontend_conf.frame_shift": 10, "frontend_conf.lfr_m": 1,
    "frontend_conf.lfr_n": 1, "frontend_conf.window": "hamming",
}
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


def config_value(config: dict[str, Any], key: str) -> Any:
    """config.yaml's value at a dotted key ("encoder_conf.output_size"), or funasr's default (None
    when funasr has none)."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return DEFAULTS.get(key)
        node = node[part]
    return node


def check_config(config: dict[str, Any], path: Path = Path("config.yaml")) -> None:
    """Refuse, naming the key, what model.py does not implement (SUPPORTED, SAME_AS); the
    geometry's own limits (a decoder FSMN that is not causal) are model.py's to refuse."""
    for key, accepted in SUPPORTED.items():
        got = config_value(config, key)
        if got not in accepted:
            raise ValueError(f"{path}: {key} is {got!r}; this implementation supports {' or '.join(map(repr, accepted))}")
    for key, other in SAME_AS.items():
        got, want = config_value(config, key), config_value(config, other)
        if got is not None and got != want:
            raise ValueError(f"{path}: {key} is {got!r}; this implementation needs it equal to {other} ({want!r})")


def _read(config: dict[str, Any], key: str, kind: type, path: Path) -> Any:
    got = config_value(config, key)
    if got is None:
        raise ValueError(f"{path}: {key} is missing (funasr has no default for it)")
    return kind(got)


def model_args(config: dict[str, Any], vocab_size: int, path: Path = Path("config.yaml")) -> ModelArgs:
    """ModelArgs from a parsed config.yaml that passed `check_config`."""
    def read(key: str, kind: type = int) -> Any:
        return _read(config, key, kind, path)

    return ModelArgs(
        input_dim=read("frontend_conf.n_mels") * read("frontend_conf.lfr_m"),
        dim=read("encoder_conf.output_size"),
        encoder_heads=read("encoder_conf.attention_heads"),
        encoder_ffn=read("encoder_conf.linear_units"),
        encoder_layers=read("encoder_conf.num_blocks"),
        encoder_kernel=read("encoder_conf.kernel_size"),
        encoder_sanm_shift=read("encoder_conf.sanm_shfit"),
        decoder_heads=read("decoder_conf.attention_heads"),
        decoder_ffn=read("decoder_conf.linear_units"),
        decoder_layers=read("decoder_conf.num_blocks"),
        decoder_kernel=read("decoder_conf.kernel_size"),
        decoder_sanm_shift=read("decoder_conf.sanm_shfit"),
        vocab_size=vocab_size,
        cif_l_order=read("predictor_conf.l_order"),
        cif_r_order=read("predictor_conf.r_order"),
        cif_threshold=read("predictor_conf.threshold", float),
        cif_tail_threshold=read("predictor_conf.tail_threshold", float),
        cif_smooth_factor=read("predictor_conf.smooth_factor", float),
        cif_noise_threshold=read("predictor_conf.noise_threshold", float),
        blank_id=read("model_conf.blank_id"),
        sos=read("model_conf.sos"),
        eos=read("model_conf.eos"),
    )


def frontend_config(config: dict[str, Any], path: Path = Path("config.yaml")) -> FrontendConfig:
    """FrontendConfig from a parsed config.yaml that passed `check_config`."""
    def read(key: str, kind: type = int) -> Any:
        return _read(config, f"frontend_conf.{key}", kind, path)

    return FrontendConfig(fs=read("fs"), n_mels=read("n_mels"), frame_length=read("frame_length"),
                          frame_shift=read("frame_shift"), lfr_m=read("lfr_m"), lfr_n=read("lfr_n"),
                          window=read("window", str))


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
    check_config(config, config_path)
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
