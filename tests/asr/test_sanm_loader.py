"""Loading FunASR model directories into voicebot/asr/sanm: the manifest check and its errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from voicebot.asr.sanm.loader import CheckpointMismatch, load_paraformer

DATA = Path(__file__).resolve().parents[1] / "data" / "paraformer" / "model"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return Path(shutil.copytree(DATA, tmp_path / "model"))


def _edit_state(model_dir: Path, edit) -> None:
    state = torch.load(model_dir / "model.pt", weights_only=True)
    edit(state)
    torch.save(state, model_dir / "model.pt")


def test_loads_every_tensor_of_the_checkpoint(model_dir):
    loaded = load_paraformer(model_dir)
    state = torch.load(model_dir / "model.pt", weights_only=True)
    ours = loaded.model.state_dict()
    assert set(ours) == set(state)
    assert all(torch.equal(ours[k], state[k]) for k in state)
    assert len(loaded.tokens) == loaded.model.args.vocab_size


def test_safetensors_and_a_wrapped_model_pt_load_the_same(model_dir):
    from safetensors.torch import save_file

    state = torch.load(model_dir / "model.pt", weights_only=True)
    # cloned: the loaded tensors are memory-mapped from model.pt, which this test rewrites
    reference = {k: v.clone() for k, v in load_paraformer(model_dir).model.state_dict().items()}
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, model_dir / "model.pt")
    assert all(torch.equal(load_paraformer(model_dir).model.state_dict()[k], v) for k, v in reference.items())
    (model_dir / "model.pt").unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(model_dir / "model.safetensors"))
    assert all(torch.equal(load_paraformer(model_dir).model.state_dict()[k], v) for k, v in reference.items())


def test_a_missing_key_is_named(model_dir):
    _edit_state(model_dir, lambda s: s.pop("decoder.decoders.1.src_attn.linear_q.weight"))
    with pytest.raises(CheckpointMismatch, match=r"missing decoder\.decoders\.1\.src_attn\.linear_q\.weight"):
        load_paraformer(model_dir)


def test_a_mis_shaped_key_is_named_with_both_shapes(model_dir):
    _edit_state(model_dir, lambda s: s.__setitem__("predictor.cif_output.weight", torch.zeros(1, 16)))
    with pytest.raises(CheckpointMismatch, match=r"shape of predictor\.cif_output\.weight \(checkpoint \(1, 16\), config\.yaml \(1, 32\)\)"):
        load_paraformer(model_dir)


def test_an_unexpected_key_is_named_but_ctc_heads_are_allowed(model_dir):
    _edit_state(model_dir, lambda s: s.__setitem__("ctc.ctc_lo.weight", torch.zeros(3, 3)))
    load_paraformer(model_dir)
    _edit_state(model_dir, lambda s: s.__setitem__("encoder.encoders.2.norm1.weight", torch.zeros(32)))
    with pytest.raises(CheckpointMismatch, match=r"unexpected encoder\.encoders\.2\.norm1\.weight"):
        load_paraformer(model_dir)


def test_a_config_with_more_layers_than_the_checkpoint_fails_naming_a_key(model_dir):
    config = yaml.safe_load((model_dir / "config.yaml").read_text())
    config["encoder_conf"]["num_blocks"] = 4
    (model_dir / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(CheckpointMismatch, match=r"missing encoder\.encoders\.2\."):
        load_paraformer(model_dir)


@pytest.mark.parametrize(("section", "key", "value", "message"), [
    (None, "model", "Paraformer", r"model is 'Paraformer'; this implementation supports 'ParaformerStreaming'"),
    (None, "encoder", "SANMEncoder", r"encoder is 'SANMEncoder'"),
    ("frontend_conf", "snip_edges", False, r"frontend_conf.snip_edges is False"),
    ("predictor_conf", "idim", 64, r"predictor_conf.idim is 64; this implementation needs it equal to encoder_conf.output_size"),
    ("encoder_conf", "input_layer", "pe", r"encoder_conf.input_layer is 'pe'"),
    ("decoder_conf", "att_layer_num", 1, r"decoder_conf.att_layer_num is 1"),
    ("predictor_conf", "l_order", None, r"predictor_conf.l_order is missing"),
    ("decoder_conf", "sanm_shfit", 0, r"not causal"),
])
def test_unsupported_architectures_are_refused_by_name(model_dir, section, key, value, message):
    config = yaml.safe_load((model_dir / "config.yaml").read_text())
    target = config[section] if section else config
    if value is None:
        del target[key]
    else:
        target[key] = value
    (model_dir / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=message):
        load_paraformer(model_dir)


def test_a_missing_am_mvn_is_an_error_not_a_silent_skip(model_dir):
    (model_dir / "am.mvn").unlink()
    with pytest.raises(FileNotFoundError, match="am.mvn"):
        load_paraformer(model_dir)
