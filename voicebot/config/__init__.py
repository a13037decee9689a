"""Settings: a YAML file from configs/ plus VOICEBOT_* environment overrides, validated at start-up.

The file is named by `--config` or `VOICEBOT_CONFIG` (default configs/default.yaml). Environment
variables override it in pydantic-settings' nested form: `VOICEBOT_TTS__VOICE=yue` sets tts.voice.
Every section forbids unknown keys, so a typo in a YAML file stops start-up with a message naming it.
The sections: server.py (server, limits, cluster), stages.py (gate, endpoint, pacing, reset, output),
engines.py (asr, tts, reply).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from voicebot.config.base import DEFAULT_CONFIG
from voicebot.config.engines import AsrConfig, ReplyConfig, TtsConfig
from voicebot.config.server import ClusterConfig, LimitsConfig, ServerConfig
from voicebot.config.stages import EndpointConfig, GateConfig, OutputConfig, PacingConfig, ResetConfig


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VOICEBOT_", env_nested_delimiter="__", extra="forbid")

    server: ServerConfig = ServerConfig()
    limits: LimitsConfig = LimitsConfig()
    gate: GateConfig = GateConfig()
    endpoint: EndpointConfig = EndpointConfig()
    pacing: PacingConfig = PacingConfig()
    reset: ResetConfig = ResetConfig()
    output: OutputConfig = OutputConfig()
    asr: AsrConfig = AsrConfig()
    tts: TtsConfig = TtsConfig()
    reply: ReplyConfig = ReplyConfig()
    cluster: ClusterConfig = ClusterConfig()
    log_level: str = "info"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first: it overrides the file's values, which arrive as init arguments.
        return env_settings, init_settings


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file and the offending keys."""


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Read the YAML file (or VOICEBOT_CONFIG, or configs/default.yaml) and apply env overrides."""
    path = Path(path or os.environ.get("VOICEBOT_CONFIG") or DEFAULT_CONFIG)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    _deep_update(data, overrides)
    try:
        return Settings(**data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid config {path}: {problems}") from exc


def _deep_update(base: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
