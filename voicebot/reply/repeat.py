"""The repeat responder: answers with what it heard, word by word (no model, no network).

Users pick it by the name "echo" (`reply.engine: echo`, the default; session.start's `responder`):
that name stays, since configs and clients use it. In the code it is the repeat responder, so that
"echo" means one thing there: the echo canceller (voicebot/audio/echo.py).
"""

from __future__ import annotations

from typing import AsyncIterator

from voicebot.engine_reports import EngineInfo
from voicebot.reply.base import Message, Responder


class RepeatResponder(Responder):
    name = "echo"  # what users call it in configs and session.start (see above)

    async def reply(self, history: list[Message], text: str, voice: str | None = None) -> AsyncIterator[str]:
        words = text.split()
        for i, word in enumerate(words):
            yield word if i == 0 else " " + word

    def info(self) -> EngineInfo:
        return EngineInfo("reply", self.name, "cpu", True)
