"""The echo responder: answers with what it heard, word by word (no model, no network)."""

from __future__ import annotations

from typing import AsyncIterator

from voicebot.engine_reports import EngineInfo
from voicebot.reply.base import Message, Responder


class EchoResponder(Responder):
    name = "echo"

    async def reply(self, history: list[Message], text: str, voice: str | None = None) -> AsyncIterator[str]:
        words = text.split()
        for i, word in enumerate(words):
            yield word if i == 0 else " " + word

    def info(self) -> EngineInfo:
        return EngineInfo("reply", self.name, "cpu", True)
