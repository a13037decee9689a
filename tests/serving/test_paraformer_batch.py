"""Why the funasr engine (`asr.engine: paraformer`, voicebot/asr/funasr_model.py) cannot batch the
sessions' streaming Paraformer chunks: funasr's CIF predictor carries a batch's state over as batch
1. Batching is done by our own implementation instead (`paraformer-batched`, voicebot/asr/sanm). If a
funasr release fixes this, this fails, and the funasr engine could batch too."""

from __future__ import annotations

import pytest
import torch

from tests.asr.tiny_models import build_model_dir
from voicebot.asr.funasr_model import load_automodel


def test_funasr_streaming_predictor_carries_a_batch_over_as_batch_one(tmp_path):
    auto = load_automodel(build_model_dir(tmp_path / "model", "paraformer-streaming"), "cpu", 1)
    model, rows = auto.model, 2
    cache = model.init_cache({}, **auto.kwargs)["encoder"]
    assert cache["cif_hidden"].shape[0] == 1 and isinstance(cache["start_idx"], int)  # one row, one position
    width = model.encoder.output_size()
    cache["cif_hidden"], cache["cif_alphas"] = torch.zeros(rows, 1, width), torch.zeros(rows, 1)  # per-row caches
    encoded = torch.randn(rows, 20, width)
    model.predictor.forward_chunk(encoded, cache)
    assert tuple(cache["cif_alphas"].shape) == (1, rows) and tuple(cache["cif_hidden"].shape) == (1, rows, width)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        model.predictor.forward_chunk(encoded, cache)  # the batch's next chunk
