import pytest

from voicebot.config import ConfigError, load_settings
from voicebot.config.base import DEFAULT_CONFIG, REPO_ROOT


def test_every_shipped_config_loads():
    for path in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        load_settings(path)


def test_default_config_selects_engines_that_need_no_downloads():
    s = load_settings(DEFAULT_CONFIG)
    assert (s.asr.engine, s.tts.engine, s.reply.engine) == ("pocketsphinx", "espeak", "echo")


def test_unknown_key_stops_start_up_naming_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tts:\n  voise: en\n")
    with pytest.raises(ConfigError, match=r"tts\.voise"):
        load_settings(path)


def test_invalid_value_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("server:\n  port: -3\n")
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_settings(path)


def test_environment_overrides_the_file_in_nested_form(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("tts:\n  voice: en\npacing:\n  lead_ms: 400\n")
    monkeypatch.setenv("VOICEBOT_TTS__VOICE", "yue")
    monkeypatch.setenv("VOICEBOT_PACING__LEAD_MS", "250")
    s = load_settings(path)
    assert s.tts.voice == "yue" and s.pacing.lead_ms == 250


def test_voicebot_config_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  port: 9123\n")
    monkeypatch.setenv("VOICEBOT_CONFIG", str(path))
    assert load_settings().server.port == 9123
