"""Resumable conversations shared by every server through Redis: resume lands wherever the client does.

The same contract as voicebot.reply.resume.ConversationStore (register, release, take; bounded by
`ttl_s` and `max_entries`, now across the whole cluster), with Redis holding what was released:

    {prefix}conv:{id}       the conversation's messages (JSON), expiring ttl_s after its release
    {prefix}live:{id}       "a server holds this conversation live", expiring after LIVE_MARK_TTL_S
    {prefix}released        sorted set id -> release time: the cluster-wide max_entries bound
    {prefix}takeover        pub/sub: "whoever holds this live conversation, release it now"

A resume whose conversation is still live on another server (that server is draining, or has not
yet seen the old socket close) asks it to release and waits up to `cluster.resume_wait_s`.
Live conversations stay in this process (its local store); so does what is released while Redis
is lost, for clients that come back to this same server.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from voicebot.cluster.link import RedisLink, RedisLost
from voicebot.reply.history import Conversation
from voicebot.reply.resume import ConversationStore

# A live mark outlives any session we expect (a show of several days); a server that crashed
# leaves marks behind, and a resume naming one waits resume_wait_s once and starts afresh.
LIVE_MARK_TTL_S = 7 * 24 * 3600
# How often a resume waiting for another server's release looks again.
TAKEOVER_POLL_S = 0.02

# Store the conversation, drop its live mark, index it, and trim the index to its bounds (ttl and
# count; the oldest released go first). KEYS: conv, live, released. ARGV: id, data, ttl_ms, now_s, max_entries, conv key prefix.
RELEASE = """
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', tonumber(ARGV[4]) - tonumber(ARGV[3]) / 1000)
local excess = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[5])
if excess > 0 then
  local oldest = redis.call('ZPOPMIN', KEYS[3], excess)
  for i = 1, #oldest, 2 do redis.call('DEL', ARGV[6] .. oldest[i]) end
end
"""

# Take a released conversation, or say that a server still holds it live (1), or nothing (nil),
# in one step: a release between two separate calls would otherwise be missed.
# KEYS: conv, live, released. ARGV: id.
TAKE = """
local data = redis.call('GETDEL', KEYS[1])
if data then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return data
end
return redis.call('EXISTS', KEYS[2]) == 1 and 1 or nil
"""


class RedisConversationStore:
    def __init__(self, link: RedisLink, ttl_s: float, max_entries: int, resume_wait_s: float,
                 new_conversation: Callable[[], Conversation]) -> None:
        self.link = link
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.resume_wait_s = resume_wait_s
        self._new_conversation = new_conversation
        self.local = ConversationStore(ttl_s, max_entries)
        self._release = link.redis.register_script(RELEASE)
        self._take = link.redis.register_script(TAKE)
        # Redis writes in flight: one per register or release, so at most a few per live session.
        self._writes: set[asyncio.Task] = set()
        link.subscribe(link.key("takeover"), self._on_takeover)

    def register(self, session_id: str, conversation: Conversation) -> None:
        self.local.register(session_id, conversation)
        self._in_background(self._mark_live(session_id))

    def release(self, session_id: str) -> None:
        if not self.link.up or self.ttl_s <= 0 or self.max_entries <= 0:
            self.local.release(session_id)
            return
        conversation = self.local.pop(session_id)
        if conversation is not None:
            self._in_background(self._store(session_id, conversation))

    async def take(self, session_id: str) -> Conversation | None:
        conversation = self.local.pop(session_id)
        if conversation is not None:
            self._in_background(self._call("take", lambda r: r.delete(self.link.key("live", session_id))))
            return conversation
        try:
            found = await self._take_released(session_id)
            if found == 1:  # live on another server: ask it to let go, and wait (bounded)
                await self.link.call("takeover", lambda r: r.publish(self.link.key("takeover"), session_id))
                deadline = time.monotonic() + self.resume_wait_s
                while found == 1 and time.monotonic() < deadline:
                    await asyncio.sleep(TAKEOVER_POLL_S)
                    found = await self._take_released(session_id)
        except RedisLost:
            return None
        return self._decode(found) if isinstance(found, bytes) else None

    async def flush(self) -> None:
        """Wait for the writes in flight (shutdown: the last sessions' conversations reach Redis)."""
        await asyncio.gather(*self._writes, return_exceptions=True)

    def __len__(self) -> int:
        """Conversations this process holds (live, or released while Redis was lost)."""
        return len(self.local)

    # ---- internals -------------------------------------------------------------------------------

    async def _take_released(self, session_id: str) -> bytes | int | None:
        keys = [self.link.key("conv", session_id), self.link.key("live", session_id), self.link.key("released")]
        return await self.link.call("take", lambda r: self._take(keys=keys, args=[session_id], client=r))

    async def _mark_live(self, session_id: str) -> None:
        await self._call("register", lambda r: r.set(self.link.key("live", session_id), self.link.instance, ex=LIVE_MARK_TTL_S))

    async def _store(self, session_id: str, conversation: Conversation) -> None:
        data = json.dumps(conversation.messages(), ensure_ascii=False)
        keys = [self.link.key("conv", session_id), self.link.key("live", session_id), self.link.key("released")]
        args = [session_id, data, int(self.ttl_s * 1000), time.time(), self.max_entries, self.link.key("conv", "")]
        try:
            await self.link.call("release", lambda r: self._release(keys=keys, args=args, client=r))
        except RedisLost:  # keep it here: a client that comes back to this server still finds it
            self.local.register(session_id, conversation)
            self.local.release(session_id)

    async def _call(self, op: str, command) -> None:
        try:
            await self.link.call(op, command)
        except RedisLost:
            pass  # counted by the link; a live mark or its removal only speeds up a resume

    def _on_takeover(self, _: str, data: bytes) -> None:
        session_id = data.decode()
        conversation = self.local.pop(session_id)
        if conversation is not None:
            self._in_background(self._store(session_id, conversation))

    def _decode(self, data: bytes) -> Conversation:
        conversation = self._new_conversation()
        for message in json.loads(data):
            if message["role"] == "user":
                conversation.add_user(message["content"])
            else:
                conversation.add_assistant(message["content"])
        return conversation

    def _in_background(self, write) -> None:
        task = asyncio.create_task(write)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
