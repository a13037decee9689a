"""The responder interface: the character's words.

`reply(history, text)` yields the reply as text deltas, as soon as each arrives. History is the
conversation so far as chat messages ({"role": "user"|"assistant", "content": ...}), holding
only what the listener actually heard of earlier replies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import AsyncIterator

from voicebot.engine import EngineInfo

Message = dict[str, str]


class Responder(ABC):
    name: str

    def load(self) -> None:
        """Prepare (blocking; at start-up). Most responders need nothing."""

    @abstractmethod
    def reply(self, history: list[Message], text: str) -> AsyncIterator[str]:
        """Text deltas of the reply to `text`; an async generator. Cancelling it must stop the work."""

    @abstractmethod
    def info(self) -> EngineInfo: ...

    async def aclose(self) -> None:
        """Release shared resources at shutdown."""
