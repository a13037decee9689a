"""Recent conversations by session id, so a client that reconnects keeps the character's memory.

A session registers its conversation when it starts and releases it when its socket closes; from
then on the conversation waits `ttl_s` for a `session.start` whose `resume` names that session.
Taking it moves it to the new session (one conversation, one owner). Bounded: expired entries go
on every call, and past `max_entries` the longest-released go first (live ones are never evicted:
there are at most server.max_sessions of them).

`take` is a coroutine because the store several servers share (voicebot.cluster.conversations,
chosen in voicebot.app.Runtime when cluster.redis_url is set) asks Redis; this one answers at once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

from voicebot.reply.history import Conversation


class ConversationStore:
    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._live: dict[str, Conversation] = {}
        # session id -> (conversation, when released), oldest release first
        self._released: OrderedDict[str, tuple[Conversation, float]] = OrderedDict()

    def register(self, session_id: str, conversation: Conversation) -> None:
        self._live[session_id] = conversation

    def release(self, session_id: str) -> None:
        """The session closed: keep its conversation for `ttl_s`."""
        conversation = self._live.pop(session_id, None)
        if conversation is None or self.ttl_s <= 0 or self.max_entries <= 0:
            return
        self._released[session_id] = (conversation, self._clock())
        self._expire()
        while len(self._released) > self.max_entries:
            self._released.popitem(last=False)

    async def take(self, session_id: str) -> Conversation | None:
        """The conversation of that session, if it is live or was released less than ttl_s ago.
        A still-live session is one whose client came back before its old socket was seen closed."""
        return self.pop(session_id)

    def pop(self, session_id: str) -> Conversation | None:
        """`take` without waiting, for the shared store's own bookkeeping."""
        self._expire()
        if session_id in self._live:
            return self._live.pop(session_id)
        entry = self._released.pop(session_id, None)
        return entry[0] if entry else None

    def __len__(self) -> int:
        return len(self._live) + len(self._released)

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._released and next(iter(self._released.values()))[1] <= cutoff:
            self._released.popitem(last=False)
