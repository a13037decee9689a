"""The responder interface: the character's words.

`reply(history, text)` yields the reply as text deltas, as soon as each arrives. History is the
conversation so far as chat messages ({"role": "user"|"assistant", "content": ...}), holding
only what the listener actually heard of earlier replies; `voice` is the session's voice, for
responders whose persona depends on it. A responder that cannot answer raises `ResponderError`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import AsyncIterator

from voicebot.engine_reports import EngineInfo

Message = dict[str, str]


class ResponderError(Exception):
    """The responder could not (finish its) reply. `kind` is a stable label for metrics:
    connect, status, first_token_timeout, total_timeout, dropped, malformed."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Responder(ABC):
    name: str

    def load(self) -> None:
        """Prepare (blocking; at start-up). Most responders need nothing."""

    @abstractmethod
    def reply(self, history: list[Message], text: str, voice: str | None = None) -> AsyncIterator[str]:
        """Text deltas of the reply to `text`; an async generator. Cancelling it must stop the work."""

    @abstractmethod
    def info(self) -> EngineInfo: ...

    async def aclose(self) -> None:
        """Release shared resources at shutdown."""
