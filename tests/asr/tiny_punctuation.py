"""Random-weight FunASR punctuation model directories (CTTransformer, CTTransformerStreaming).

The same files a ModelScope download of ct-punc has (config.yaml, configuration.json, model.pt,
tokens.json), loaded by exactly the code that loads real weights (voicebot/asr/punctuation.py).
"tiny" builds in about a second; "ct-punc-c" has the released model's exact shape
(iic/punc_ct-transformer_zh-cn-common-vocab272727-pytorch: a 272,727-token vocabulary, 256-wide,
8 heads, 4 SAN-M blocks: 291 MB of model.pt) and exists for bench/punctuation.py: its compute per
call is the real model's, only its marks are nonsense.

Nothing here downloads anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml

Kind = Literal["CTTransformer", "CTTransformerStreaming"]  # the offline and the realtime class
Size = Literal["tiny", "ct-punc-c"]
PUNC_LIST = ["<unk>", "_", "，", "。", "？", "、"]  # the released models' classes, in their order

_SPECIALS = ["<blank>", "<s>", "</s>"]
_CJK = [chr(c) for c in range(0x4E00, 0xA000)]  # the CJK Unified Ideographs block: every character of the test sets
_DIMS = {
    "tiny": {"d": 32, "heads": 2, "ffn": 64, "blocks": 2, "vocab": len(_SPECIALS) + len(_CJK) + 1},
    "ct-punc-c": {"d": 256, "heads": 8, "ffn": 1024, "blocks": 4, "vocab": 272727},
}


def _tokens(size: Size) -> list[str]:
    """Characters first, then (at the released size) placeholder words up to its vocabulary size."""
    tokens = _SPECIALS + _CJK
    fill = _DIMS[size]["vocab"] - len(tokens) - 1
    return tokens + [f"w{i}" for i in range(fill)] + ["<unk>"]


def _config(kind: Kind, size: Size) -> dict:
    dims = _DIMS[size]
    return {
        "model": kind,
        "model_conf": {"ignore_id": 0, "embed_unit": dims["d"], "att_unit": dims["d"], "dropout_rate": 0.1,
                       "punc_list": PUNC_LIST, "punc_weight": [1.0] * len(PUNC_LIST), "sentence_end_id": 3},
        "encoder": "SANMVadEncoder" if kind == "CTTransformerStreaming" else "SANMEncoder",
        "encoder_conf": {"input_size": dims["d"], "output_size": dims["d"], "attention_heads": dims["heads"],
                         "linear_units": dims["ffn"], "num_blocks": dims["blocks"], "dropout_rate": 0.1,
                         "positional_dropout_rate": 0.1, "attention_dropout_rate": 0.0, "input_layer": "pe",
                         "pos_enc_class": "SinusoidalPositionEncoder", "normalize_before": True,
                         "kernel_size": 11, "sanm_shfit": 0, "selfattention_layer_type": "sanm"},
        "tokenizer": "CharTokenizer",
        "tokenizer_conf": {"unk_symbol": "<unk>"},
    }


def build_punctuation_dir(out: str | Path, kind: Kind = "CTTransformer", size: Size = "tiny",
                          mark: str | None = None, seed: int = 0) -> Path:
    """Write a loadable punctuation model directory with random weights; returns its path.

    `mark`: the class the model gives every word (its output layer biased to it), so a test knows
    the answer; None leaves the random weights' answers. Either way the "<unk>" class is never
    given, as a trained model never gives it.
    """
    import torch
    from funasr.register import tables

    import funasr  # noqa: F401  (importing funasr registers its classes in `tables`)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = _config(kind, size)
    tokens = _tokens(size)
    model = tables.model_classes[kind](**config["model_conf"], **{k: v for k, v in config.items() if k != "model_conf"},
                                       vocab_size=len(tokens))
    with torch.no_grad():
        model.decoder.bias[0] = -30.0
        if mark is not None:
            model.decoder.bias[PUNC_LIST.index(mark)] = 30.0
    (out / "tokens.json").write_text(json.dumps(tokens, ensure_ascii=False), encoding="utf-8")
    (out / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True, sort_keys=False), encoding="utf-8")
    files = {"init_param": "model.pt", "config": "config.yaml", "tokenizer_conf": {"token_list": "tokens.json"}}
    (out / "configuration.json").write_text(
        json.dumps({"framework": "pytorch", "task": "punctuation", "file_path_metas": files}), encoding="utf-8")
    torch.save(model.state_dict(), out / "model.pt")
    return out
