"""scripts/calibrate_threshold.py on clips whose references are what the dialect model hears."""

from __future__ import annotations

import importlib.util
import sys

import soundfile
import yaml

from tests.asr.tiny_models import synthetic_speech
from voicebot.asr.funasr_model import FunasrModel
from voicebot.config.base import REPO_ROOT


def test_calibration_finds_the_threshold_that_helps(tiny_models, tmp_path, capsys, monkeypatch):
    dialect = FunasrModel("dialect", tiny_models["streaming-sure"])
    dialect.load()
    clips = tmp_path / "clips"
    clips.mkdir()
    for i in range(3):
        audio = synthetic_speech(2.0 + i, seed=50 + i)
        soundfile.write(clips / f"clip{i}.wav", audio, 16000)
        (clips / f"clip{i}.txt").write_text(dialect.decode_blocking(audio).text, encoding="utf-8")
    dialect.close()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"asr": {"engine": "paraformer", "paraformer": {
        "model": str(tiny_models["streaming-unsure"]), "dialect": {"model": str(tiny_models["streaming-sure"])}}}}))

    spec = importlib.util.spec_from_file_location("calibrate", REPO_ROOT / "scripts" / "calibrate_threshold.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "calibrate", script)  # dataclasses look their module up there
    spec.loader.exec_module(script)
    monkeypatch.setattr("sys.argv", ["calibrate", "--config", str(config), "--clips", str(clips)])
    script.main()

    out = capsys.readouterr().out
    assert "3 clips" in out
    # The unsure primary is below every candidate, and falling back fixes every clip.
    assert "best system accuracy 1.000 at fallback_threshold 0.30" in out
