"""hparams (HyperPyYAML without the classes), model resolution and strict checkpoint loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from voicebot.models import ModelNotAvailable as ModelUnavailable
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.loader import load_checkpoint, load_cosyvoice2, resolve_dtype, resolve_model_dir

YAML = """
n: 3
ratio: 2
name: base
rate: 1e-06
scaled: !ref <n> * <ratio> + 1
path: !ref <name>/sub
same: !ref <obj>
copied: !copy <obj>
obj: !new:pkg.mod.Cls
    size: !ref <n>
    inner: !name:pkg.fn
        k: 1
seed: !apply:random.seed [7]
positional: !new:pkg.Other [1, 2]
bare: !new:pkg.Bare
"""


def _model_dir(tmp_path: Path, text: str = YAML) -> Path:
    (tmp_path / "cosyvoice2.yaml").write_text(text)
    return tmp_path


def test_tags_become_plain_dicts_and_nothing_is_imported(tmp_path: Path) -> None:
    h = load_hparams(_model_dir(tmp_path))
    assert h["obj"] == {"__class__": "pkg.mod.Cls", "size": 3, "inner": {"__function__": "pkg.fn", "k": 1}}
    assert h["seed"] == {"__apply__": "random.seed", "__args__": [7]}
    assert h["positional"] == {"__class__": "pkg.Other", "__args__": [1, 2]}
    assert h["bare"] == {"__class__": "pkg.Bare"}
    assert h["scaled"] == 7 and h["path"] == "base/sub" and h["rate"] == 1e-6
    assert h["same"] is h["obj"]  # a plain !ref shares the object, as HyperPyYAML does
    assert h["copied"] == h["obj"] and h["copied"] is not h["obj"]
    assert h["qwen_pretrain_path"] == str(tmp_path / "CosyVoice-BlankEN")


def test_overrides_apply_before_references(tmp_path: Path) -> None:
    h = load_hparams(_model_dir(tmp_path), {"n": 5})
    assert h["scaled"] == 11 and h["obj"]["size"] == 5


def test_unknown_reference_is_named(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="missing"):
        load_hparams(_model_dir(tmp_path, "a: !ref <missing>\n"))


@pytest.mark.golden
def test_official_yaml(cv2_dir: Path) -> None:
    h = load_hparams(cv2_dir, {"qwen_pretrain_path": "/elsewhere"})
    llm, flow, hift = h["llm"], h["flow"], h["hift"]
    assert llm["__class__"].endswith("Qwen2LM") and llm["llm"]["pretrain_path"] == "/elsewhere"
    assert llm["llm_input_size"] == h["llm_input_size"] and llm["sampling"]["__function__"].endswith("ras_sampling")
    estimator = flow["decoder"]["estimator"]
    assert estimator["static_chunk_size"] == h["chunk_size"] * h["token_mel_ratio"]
    assert flow["encoder"]["static_chunk_size"] == h["chunk_size"]
    assert isinstance(flow["decoder"]["cfm_params"]["content"]["sigma_min"], float)
    assert hift["sampling_rate"] == h["sample_rate"] and h["hifigan"]["generator"] is hift
    assert h["get_tokenizer"]["token_path"] == "/elsewhere"


@pytest.mark.golden
def test_load_fixture_directory(cv2_dir: Path) -> None:
    m = load_cosyvoice2(cv2_dir)
    assert m.dtype == torch.float32
    for module, name in ((m.lm, "llm.pt"), (m.flow, "flow.pt"), (m.hift, "hift.pt")):
        assert not module.training
        state = {k.replace("generator.", ""): v for k, v in torch.load(cv2_dir / name, weights_only=True).items()}
        ours = module.state_dict()
        assert ours.keys() == state.keys()
        assert all(torch.equal(ours[k], v) and ours[k].dtype == torch.float32 for k, v in state.items())
        # on CPU every Linear weight is stored column-major (cpu_weight_layout), same values and shape
        linears = [x for x in module.modules() if isinstance(x, nn.Linear)]
        assert linears and all(x.weight.t().is_contiguous() for x in linears)


def test_dtype_defaults() -> None:
    assert resolve_dtype(None, torch.device("cuda")) == torch.float16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cuda")) == torch.bfloat16


class _Vocoder(nn.Module):
    def __init__(self, legacy: bool) -> None:
        super().__init__()
        conv = nn.ConvTranspose1d(4, 3, 5)
        if legacy:
            self.up = nn.utils.weight_norm(conv)
        else:
            self.up = nn.utils.parametrizations.weight_norm(conv)
        self.lin = nn.Linear(2, 2)


@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated:FutureWarning")
@pytest.mark.parametrize("legacy_file", [False, True])
def test_hift_weight_norm_spellings_and_generator_prefix(tmp_path: Path, legacy_file: bool) -> None:
    torch.manual_seed(0)
    source = _Vocoder(legacy=legacy_file)
    path = tmp_path / "hift.pt"
    torch.save({f"generator.{k}": v for k, v in source.state_dict().items()}, path)
    target = _Vocoder(legacy=not legacy_file)
    load_checkpoint(target, path, strip="generator.")
    x = torch.randn(1, 4, 6)
    torch.testing.assert_close(target.up(x), source.up(x))


def test_strict_load_rejects_unexpected_keys(tmp_path: Path) -> None:
    module = nn.Linear(2, 2)
    torch.save({**module.state_dict(), "extra": torch.zeros(1)}, tmp_path / "m.pt")
    with pytest.raises(RuntimeError, match="extra"):
        load_checkpoint(module, tmp_path / "m.pt")


def test_resolve_local_directory(tmp_path: Path) -> None:
    assert resolve_model_dir(str(_model_dir(tmp_path)), tmp_path / "cache", "tts.cosyvoice2.model") == tmp_path
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelUnavailable, match="tts.cosyvoice2.model.*without cosyvoice2.yaml"):
        resolve_model_dir(str(tmp_path / "empty"), tmp_path, "tts.cosyvoice2.model")
    with pytest.raises(ModelUnavailable, match="not a ModelScope id"):
        resolve_model_dir(str(tmp_path / "no" / "such" / "dir"), tmp_path, "tts.cosyvoice2.model")


def test_resolve_cached_modelscope_id_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import modelscope

    def offline(*args: object, **kwargs: object) -> str:
        raise ConnectionError("Failed to resolve 'modelscope.cn'\nlong traceback text")

    monkeypatch.setattr(modelscope, "snapshot_download", offline)
    with pytest.raises(ModelUnavailable) as err:
        resolve_model_dir("iic/CosyVoice2-0.5B", tmp_path, "tts.cosyvoice2.model")
    message = str(err.value)
    assert "tts.cosyvoice2.model" in message and "iic/CosyVoice2-0.5B" in message and "long traceback" not in message
    assert err.value.__cause__ is None

    cached = tmp_path / "iic" / "CosyVoice2-0.5B"
    cached.mkdir(parents=True)
    for name in ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt"):
        (cached / name).touch()
    assert resolve_model_dir("iic/CosyVoice2-0.5B", tmp_path, "tts.cosyvoice2.model") == cached
