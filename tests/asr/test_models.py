"""Model provisioning: resolve without network, fetch into the cache, the check/fetch command."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import yaml

from voicebot import models
from voicebot.config import load_settings
from voicebot.config.base import REPO_ROOT


def write_config(path: Path, paraformer: dict) -> Path:
    path.write_text(yaml.safe_dump({"asr": {"engine": "paraformer", "paraformer": paraformer}}), encoding="utf-8")
    return path


def test_check_reports_local_models_and_sizes(tiny_models, tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", {"model": str(tiny_models["streaming"]),
                                                "offline_model": str(tiny_models["offline"])})
    assert models.main(["check", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "asr.paraformer.model" in out and "asr.paraformer.offline_model" in out and "2/2 models present" in out


def test_fetch_downloads_ids_into_the_cache(tiny_models, tmp_path, monkeypatch, capsys):
    downloads = []

    def fake_snapshot_download(model_id, local_dir):
        downloads.append(model_id)
        shutil.copytree(tiny_models["streaming"], local_dir, dirs_exist_ok=True)
        return local_dir

    import modelscope

    monkeypatch.setattr(modelscope, "snapshot_download", fake_snapshot_download)
    config = write_config(tmp_path / "c.yaml", {"model": "someone/some-model", "model_cache": str(tmp_path / "cache")})
    assert models.main(["fetch", "--config", str(config)]) == 0
    assert downloads == ["someone/some-model"]
    assert models.is_complete(tmp_path / "cache" / "someone" / "some-model")
    # Once fetched, start-up finds it without any download.
    settings = load_settings(config)
    assert models.resolve(models.required_models(settings)[0]) == tmp_path / "cache" / "someone" / "some-model"
    assert "1/1 models present" in capsys.readouterr().out


def test_a_directory_that_is_not_a_model_is_refused(tmp_path):
    with pytest.raises(models.ModelNotAvailable, match="not a model"):
        models.resolve(models.ModelRef("asr.paraformer.model", str(tmp_path), tmp_path / "cache"))


@pytest.mark.parametrize("name, count", [("cpu", 1), ("a10", 5), ("cpu-cosyvoice", 2)])
def test_shipped_configs_name_their_models(name, count):
    settings = load_settings(REPO_ROOT / "configs" / f"{name}.yaml")
    refs = models.required_models(settings)
    assert len(refs) == count and refs[0].key == "asr.paraformer.model"
    if settings.tts.engine == "cosyvoice2":
        assert refs[-1].key == "tts.cosyvoice2.model" and "llm.pt" in refs[-1].files
    assert settings.asr.paraformer.chunk_size == (0, 10, 5)


def test_start_up_downloads_only_when_the_setting_says_so(tiny_models, tmp_path, monkeypatch):
    from voicebot.runtime import Runtime

    downloads = []

    def fake_snapshot_download(model_id, local_dir):
        downloads.append(model_id)
        shutil.copytree(tiny_models["streaming"], local_dir, dirs_exist_ok=True)
        return local_dir

    import modelscope

    monkeypatch.setattr(modelscope, "snapshot_download", fake_snapshot_download)
    paraformer = {"model": "someone/some-model", "model_cache": str(tmp_path / "cache")}
    settings = load_settings(write_config(tmp_path / "c.yaml", paraformer))
    refused = Runtime(settings)
    with pytest.raises(models.ModelNotAvailable) as error:
        refused.load()
    asyncio.run(refused.close())
    assert "asr.paraformer.model" in str(error.value) and "someone/some-model" in str(error.value)
    assert downloads == []  # the default: start-up never downloads

    settings.server.download_models = True
    runtime = Runtime(settings)
    runtime.load()
    assert downloads == ["someone/some-model"] and runtime.ready
    asyncio.run(runtime.close())


def test_a_failed_download_is_one_clear_error(tmp_path, monkeypatch):
    import modelscope

    def offline(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'modelscope.cn'\nlong traceback text")

    monkeypatch.setattr(modelscope, "snapshot_download", offline)
    with pytest.raises(models.ModelNotAvailable) as error:
        models.fetch(models.ModelRef("tts.cosyvoice2.model", "iic/CosyVoice2-0.5B", tmp_path, models.COSYVOICE2_FILES))
    message = str(error.value)
    assert "tts.cosyvoice2.model" in message and "iic/CosyVoice2-0.5B" in message and "long traceback" not in message
