"""A FunASR client's first message (and any later one that changes it): the mode it asks for, the
stream's name, its audio's format and rate, checked; what voicebot/frontends/funasr_protocol.py's
session reads them from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from voicebot.asr.base import SAMPLE_RATE

Mode = Literal["online", "offline", "2pass"]
_MODES = ("online", "offline", "2pass")


class FunasrMessageError(ValueError):
    """A FunASR client message we cannot follow (a field we refuse); the session ends the stream with
    its reason. (voicebot.protocol.ProtocolError is /v1/voice's: `load_json` raises it here too.)"""


@dataclass
class ClientConfig:
    mode: Mode = "2pass"
    wav_name: str = "stream"
    # "pcm", or anything else for a whole file (the label is kept for messages, never trusted)
    wav_format: str = "pcm"
    audio_fs: int = SAMPLE_RATE

    def update(self, message: dict) -> None:
        """Apply a client message; raises FunasrMessageError (with wav_name applied) on a field we refuse."""
        # The name first: the error result of a refused message must carry it.
        self.wav_name = str(message.get("wav_name", self.wav_name))
        mode = message.get("mode", self.mode)
        if mode not in _MODES:
            raise FunasrMessageError(f"mode must be one of {', '.join(_MODES)}, not {mode!r}")
        audio_fs = _sample_rate(message.get("audio_fs", self.audio_fs))
        wav_format = str(message.get("wav_format") or self.wav_format).lower()
        self.mode, self.audio_fs, self.wav_format = mode, audio_fs, wav_format

    @property
    def is_file(self) -> bool:
        return self.wav_format != "pcm"


def _sample_rate(value: object) -> int:
    # Some clients send the rate as a string or a float ("16000", 16000.0).
    try:
        rate = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        rate = float("nan")
    if isinstance(value, bool) or not rate.is_integer() or not 8000 <= rate <= 48000:
        raise FunasrMessageError(f"audio_fs must be a sample rate in 8000-48000 Hz, not {value!r}")
    return int(rate)
