"""A session's conversation: what the user said and what the listener actually heard of each reply.

Bounded by a turn budget and an estimated-token budget: past either, the oldest messages go first
(a user message takes its reply with it, so the history never starts with an orphaned answer).
It belongs to the responder side: the periodic reset clears engine state, never this, and a
reconnecting client can take it over (voicebot.reply.resume).
"""

from __future__ import annotations

from collections import deque

from voicebot.reply.base import Message
from voicebot.text import is_cjk


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate: one token per CJK character, one per four other characters
    (close to what Qwen and Llama tokenizers give, and cheap enough to run on every turn)."""
    cjk = sum(map(is_cjk, text))
    return cjk + (len(text) - cjk + 3) // 4


class Conversation:
    def __init__(self, max_turns: int, max_tokens: int = 0) -> None:
        self.max_tokens = max_tokens
        # Each turn is a user message and, when the bot answered, its reply.
        self._messages: deque[Message] = deque(maxlen=max(2, 2 * max_turns))
        self._tokens = 0
        # The client's own system prompt for this conversation (/v1/realtime `instructions`);
        # the responder uses it instead of the configured persona. None: the persona.
        self.instructions: str | None = None

    def add_user(self, text: str) -> None:
        self._append({"role": "user", "content": text})

    def add_assistant(self, heard: str) -> None:
        if heard:
            self._append({"role": "assistant", "content": heard})

    def revise_assistant(self, said: str, heard: str) -> bool:
        """Replace the latest reply recorded as `said` by what the listener says it heard (a client
        that knows its playback better than the server's estimate); an empty `heard` removes it."""
        for index in range(len(self._messages) - 1, -1, -1):
            message = self._messages[index]
            if message["role"] == "assistant" and message["content"] == said:
                self._tokens -= estimate_tokens(said)
                if heard:
                    self._messages[index] = {"role": "assistant", "content": heard}
                    self._tokens += estimate_tokens(heard)
                else:
                    del self._messages[index]
                return True
        return False

    def messages(self) -> list[Message]:
        return list(self._messages)

    def copy(self) -> "Conversation":
        """Another conversation with the same messages and instructions."""
        twin = Conversation(1, self.max_tokens)
        twin._messages = deque(self._messages, maxlen=self._messages.maxlen)
        twin._tokens, twin.instructions = self._tokens, self.instructions
        return twin

    def clear(self) -> None:
        """Forget every message (the instructions stay)."""
        self._messages.clear()
        self._tokens = 0

    @property
    def tokens(self) -> int:
        return self._tokens

    def _append(self, message: Message) -> None:
        if len(self._messages) == self._messages.maxlen:
            self._drop_oldest()
        self._messages.append(message)
        self._tokens += estimate_tokens(message["content"])
        # The newest exchange always stays, even alone over the budget: the reply needs it.
        while self.max_tokens and self._tokens > self.max_tokens and len(self._messages) > 2:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        self._tokens -= estimate_tokens(self._messages.popleft()["content"])
        while self._messages and self._messages[0]["role"] == "assistant":
            self._tokens -= estimate_tokens(self._messages.popleft()["content"])
