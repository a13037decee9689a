"""The character's persona: the system prompt a responder sends, per voice when configured.

Files are read once, at start-up (`load`), so a missing file stops the server with a message
naming the config key instead of failing the first reply of the show.
"""

from __future__ import annotations

from voicebot.config.engines import PersonaConfig


class Personas:
    def __init__(self, default: PersonaConfig | None, by_voice: dict[str, PersonaConfig]) -> None:
        self._configs = {None: default, **by_voice}
        self._texts: dict[str | None, str] = {}

    def load(self) -> None:
        for voice, config in self._configs.items():
            if config is None:
                continue
            key = "reply.persona" if voice is None else f"reply.voice_personas.{voice}"
            self._texts[voice] = _read(config, key)

    def system_prompt(self, voice: str | None) -> str | None:
        """The voice's own persona, else the default one, else None (no system message)."""
        return self._texts.get(voice) or self._texts.get(None)


def _read(config: PersonaConfig, key: str) -> str:
    if config.text is not None:
        return config.text.strip()
    try:
        return config.file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key}.file: cannot read {config.file}: {exc}") from exc
