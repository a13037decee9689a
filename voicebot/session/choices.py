"""What a client chose for its session (session.start, then session.update), checked against what
the server offers: an unknown voice or responder is a ProtocolError and changes nothing."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from voicebot import protocol
from voicebot.protocol import ErrorCode, ProtocolError
from voicebot.tts.base import VoiceInfo


@dataclass
class Choices:
    responder: str
    barge_in_min_ms: int
    language: str | None = None

    def apply(self, voice: str | None, responder: str | None, language: str | None,
              endpointing: protocol.EndpointingUpdate | None, voices: list[VoiceInfo], responders: Collection[str]) -> None:
        """Check every choice first, then take them: a refused message leaves the session as it was."""
        if voice is not None and voice not in {v.name for v in voices}:
            raise ProtocolError(ErrorCode.UNKNOWN_VOICE, f"unknown voice {voice!r}; available: {', '.join(v.name for v in voices)}")
        if responder is not None and responder not in responders:
            raise ProtocolError(ErrorCode.UNKNOWN_RESPONDER, f"unknown responder {responder!r}; available: {', '.join(responders)}")
        if responder is not None:
            self.responder = responder
        if language is not None:
            self.language = language
        if endpointing is not None and endpointing.barge_in_min_ms is not None:
            self.barge_in_min_ms = endpointing.barge_in_min_ms
