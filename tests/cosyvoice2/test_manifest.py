"""Released-size modules, built on the meta device, have exactly the state-dict keys, shapes and
dtypes of manifest_full.json (made from the official classes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from voicebot.tts.cosyvoice2.flow import build_flow
from voicebot.tts.cosyvoice2.hift import build_hift
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.lm import build_lm

pytestmark = pytest.mark.golden


def _released_hparams(fixture_dir: Path, qwen_dir: Path) -> dict:
    """The fixture yaml with the sizes of the released cosyvoice2.yaml (README: only these differ)."""
    sizes = {"llm_input_size": 896, "llm_output_size": 896}
    h = load_hparams(fixture_dir, {**sizes, "qwen_pretrain_path": str(qwen_dir)})
    h["llm"]["speech_token_size"] = 6561
    flow = h["flow"]
    flow.update(input_size=512, vocab_size=6561)
    flow["encoder"].update(output_size=512, input_size=512, attention_heads=8, linear_units=2048, num_blocks=6)
    flow["decoder"]["estimator"].update(channels=[256], attention_head_dim=64, n_blocks=4, num_mid_blocks=12, num_heads=8)
    h["hift"]["base_channels"] = 512
    h["hift"]["f0_predictor"]["cond_channels"] = 512
    return h


@pytest.fixture(scope="module")
def released(cv2_dir: Path, cv2_manifest: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, nn.Module]:
    qwen_dir = tmp_path_factory.mktemp("CosyVoice-BlankEN")
    (qwen_dir / "config.json").write_text(json.dumps(cv2_manifest["qwen2_config"]))
    h = _released_hparams(cv2_dir, qwen_dir)
    with torch.device("meta"):
        return {"llm": build_lm(h), "flow": build_flow(h["flow"]), "hift": build_hift(h["hift"])}


@pytest.mark.parametrize("name", ["llm", "flow", "hift"])
def test_state_dict_matches_manifest(released: dict[str, nn.Module], cv2_manifest: dict, name: str) -> None:
    module, manifest = released[name], cv2_manifest[name]
    ours = {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in module.state_dict().items()}
    expected = {e["name"]: (e["shape"], e["dtype"]) for e in manifest["keys"]}
    assert sorted(set(ours) - set(expected)) == [] and sorted(set(expected) - set(ours)) == []
    assert ours == expected
    assert len(ours) == manifest["num_keys"]
    assert sum(p.numel() for p in module.parameters()) == manifest["num_params_unique"]
