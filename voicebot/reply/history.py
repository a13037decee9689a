"""A session's conversation: what the user said and what the listener actually heard of each reply.

Bounded to the last `max_turns` exchanges. It belongs to the responder side: the periodic reset
clears engine state, never this.
"""

from __future__ import annotations

from collections import deque

from voicebot.reply.base import Message


class Conversation:
    def __init__(self, max_turns: int) -> None:
        # Each turn is a user message and, when the bot answered, its reply.
        self._messages: deque[Message] = deque(maxlen=max(2, 2 * max_turns))

    def add_user(self, text: str) -> None:
        self._messages.append({"role": "user", "content": text})

    def add_assistant(self, heard: str) -> None:
        if heard:
            self._messages.append({"role": "assistant", "content": heard})

    def messages(self) -> list[Message]:
        return list(self._messages)
