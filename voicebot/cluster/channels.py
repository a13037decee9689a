"""Channels across servers: a listener on one server hears the speaker on another, through Redis pub/sub,
and a channel has one owner in the whole cluster.

Fan-out rather than routing each channel to one server (docs/deploy.md says why): every connection
may land anywhere, and the load balancer stays on least connections.

    {prefix}ch:{name}     what the channel's speaker is sent: instance id (32 hex) + b"t" text | b"b" audio, + payload
    {prefix}speakers      JSON {channel, instance, speaking}: who speaks where
    {prefix}owner:{name}  the speaker's owner id (a hash of its resume token), expiring cluster.channel_owner_ttl_s
                          after its server last renewed it
    {prefix}muted         the set of channels the operator muted (the console's mute); every server
                          reads it when it reaches Redis, and
    {prefix}mute          JSON {channel, muted}: each change of it, published as it is made

Ownership is decided in Redis, atomically (CLAIM): a session speaks on a channel only if no one owns
it, or it resumed the owner's conversation (as on one server: only the owner's client knows the resume
token), and its server renews the key every third of its TTL while the speaker is connected (KEEP). A
speaker whose key another took meanwhile (its server was cut off from Redis past the TTL) stops
speaking on the channel and is told (`channel_lost`), as is one whose channel a session on another
server claimed. While Redis is lost no session can claim a channel (`cluster_unavailable`:
no one can tell who owns it); speakers already speaking go on, heard by their own server's
listeners, and their keys are renewed (taken again if they expired) once Redis is back.

Listeners on the speaker's own server are served directly, as on a single server. Every server
subscribes to every channel with one pattern subscription made at start-up, so a listener hears its
channel from its first moment; a server passes on only the channels it has listeners for (each
receives all speaking channels: 48 KB/s of audio each). Publishing never waits: messages queue
(bounded) for one publisher task, and what cannot be published (queue full, Redis lost) is counted
in voicebot_cluster_relay_dropped_total{reason}. While Redis is lost each server's channels are local.

A muted channel is muted for every listener on every server, whichever server its speaker is on:
the mute is the cluster's (the set above), the speaker's server does not relay the channel's reply
audio, and a listener's server drops any that arrives (frames published before the mute reached
the speaker's server), each counted in voicebot_channel_muted_frames_total. The muting server mutes
its own listeners at once, whatever Redis says; while Redis is lost a (un)mute holds on that server
only and is refused (`cluster_unavailable`) so the operator knows, and once Redis is back every
server takes the cluster's set again, which that change is not in: it must be made again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from typing import Callable

from prometheus_client import Counter

from voicebot import protocol
from voicebot.channels import ChannelHub, ChannelRefused, Tell, taken_message
from voicebot.cluster.link import CLUSTER_UNAVAILABLE, RedisLink, RedisLost
from voicebot.metrics import Metrics
from voicebot.protocol import ErrorCode
from voicebot.transport import Wire

log = logging.getLogger("voicebot.cluster")

# Messages waiting to be published, all channels together: 256 x 9.6 KB frames = 2.4 MB at most,
# about 50 s of one channel's audio. Full means Redis is far slower than real time.
PUBLISH_QUEUE_MAX = 256
# Messages sent in one pipeline (one round trip).
PUBLISH_BATCH_MAX = 32
INSTANCE_LEN = 32
TEXT, AUDIO = b"t", b"b"

# Take the channel if no one owns it, we do already, or we resumed its owner's conversation.
# KEYS: owner key. ARGV: our owner id, the resumed owner id ("" if none), ttl_ms. 1: ours.
CLAIM = """
local current = redis.call('GET', KEYS[1])
if current == false or current == ARGV[1] or (ARGV[2] ~= '' and current == ARGV[2]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
"""
# Renew each key we own (taking it again if it expired); 0 for one another took meanwhile.
# KEYS: owner keys. ARGV: our owner id for each, then ttl_ms.
KEEP = """
local ttl, kept = ARGV[#ARGV], {}
for i, key in ipairs(KEYS) do
  local current = redis.call('GET', key)
  if current == false or current == ARGV[i] then
    redis.call('SET', key, ARGV[i], 'PX', ttl)
    kept[i] = 1
  else
    kept[i] = 0
  end
end
return kept
"""
# Delete the key if it is still ours. KEYS: owner key. ARGV: our owner id.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def owner_id(resume_token: str) -> str:
    """What Redis holds of an owner: not the secret itself."""
    return hashlib.sha256(resume_token.encode()).hexdigest()[:32]


class ClusterChannelHub(ChannelHub):
    def __init__(self, metrics: Metrics, max_listeners: int, link: RedisLink, owner_ttl_s: float) -> None:
        super().__init__(metrics, max_listeners)
        self.link = link
        self.owner_ttl_s = owner_ttl_s
        self._owned: dict[str, str] = {}  # channel -> owner id, of this server's speakers
        self._claim = link.redis.register_script(CLAIM)
        self._keep = link.redis.register_script(KEEP)
        self._release = link.redis.register_script(RELEASE)
        self._keep_now = asyncio.Event()  # Redis is back: renew at once
        self._keeper: asyncio.Task | None = None
        # Redis releases in flight: one per speaker that left, each a single round trip.
        self._releases: set[asyncio.Task] = set()
        self.claims = Counter("voicebot_cluster_channel_claims_total",
                              "Channel claims by sessions, by outcome (granted; taken: another owns it; unavailable: "
                              "Redis lost; lost: a speaker's channel found taken when its key was renewed)",
                              ["outcome"], registry=metrics.registry)
        for outcome in ("granted", "taken", "unavailable", "lost"):
            self.claims.labels(outcome)
        self._me = link.instance.encode()
        self._outgoing: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(PUBLISH_QUEUE_MAX)
        self._remote_speakers: dict[str, str] = {}  # channel -> instance of the server its speaker is on
        self._publisher: asyncio.Task | None = None
        self.relay_dropped = Counter("voicebot_cluster_relay_dropped_total",
                                     "Channel messages not published to other servers, by reason", ["reason"],
                                     registry=metrics.registry)
        self.relayed = Counter("voicebot_cluster_relayed_total", "Channel messages relayed through Redis, by direction",
                               ["direction"], registry=metrics.registry)
        for reason in ("queue_full", "redis_lost"):
            self.relay_dropped.labels(reason)
        self._channel_prefix = link.key("ch", "")
        link.subscribe(link.key("speakers"), self._on_speaker)
        link.subscribe(self._channel_prefix + "*", self._on_channel)
        link.subscribe(link.key("mute"), self._on_mute)
        self._mutes_loading: set[asyncio.Task] = set()  # reading the cluster's muted set: one per time Redis came back
        link.on_change(self._on_link_change)

    def start(self) -> None:
        self._publisher = asyncio.create_task(self._publish(), name="channel-publisher")
        self._keeper = asyncio.create_task(self._keep_owned(), name="channel-owner-keeper")

    async def flush_releases(self) -> None:
        """Wait for the owner keys being released (shutdown: its speakers' channels are free at once)."""
        await asyncio.gather(*self._releases, return_exceptions=True)

    async def close(self) -> None:
        await self.flush_releases()
        for task in self._mutes_loading:
            task.cancel()
        await asyncio.gather(*self._mutes_loading, return_exceptions=True)
        for task in (t for t in (self._publisher, self._keeper) if t is not None):
            # Cancelled until done: on Python 3.11 asyncio.wait_for (inside link.call) can swallow a
            # cancellation that comes as its call completes, and the task would wait on for ever.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)

    # ---- the speaker's side ----------------------------------------------------------------------

    async def claim(self, name: str, session_id: str, owner: str, resumed_from: str | None = None,
                    tell: Tell | None = None) -> None:
        if self.held_against(name, resumed_from):  # a speaker here owns it: no need to ask Redis
            self.claims.labels("taken").inc()
            raise ChannelRefused(ErrorCode.CHANNEL_TAKEN, taken_message(name))
        mine = owner_id(owner)
        args = [mine, owner_id(resumed_from) if resumed_from else "", int(self.owner_ttl_s * 1000)]
        try:
            granted = await self.link.call("claim", lambda r: self._claim(keys=[self._owner_key(name)], args=args, client=r))
        except RedisLost:
            self.claims.labels("unavailable").inc()
            raise ChannelRefused(CLUSTER_UNAVAILABLE, f"lost the cluster's Redis: no one can tell who owns channel {name!r} "
                                 "now; this session goes on without it (reconnect to claim it once Redis is back)") from None
        # Asked again after the wait: a session here may have taken it meanwhile.
        if not granted or not self.speak(name, session_id, owner, resumed_from, tell):
            if granted:
                self._release_later(name, mine)
            self.claims.labels("taken").inc()
            raise ChannelRefused(ErrorCode.CHANNEL_TAKEN, taken_message(name))
        self.claims.labels("granted").inc()
        self._owned[name] = mine
        self._remote_speakers.pop(name, None)
        self._announce(name, speaking=True)

    def leave(self, session_id: str) -> None:
        name = self._vacate(session_id)
        if name is None:
            return
        if (mine := self._owned.pop(name, None)) is not None:
            # Told once released, here and on the other servers: a listener told the channel is free
            # finds it so (told sooner, a client it told could connect and be refused channel_taken).
            self._release_later(name, mine, then=lambda: self._free(name))
        else:
            self._free(name)

    def _free(self, name: str) -> None:
        if self._tell_free(name):
            self._announce(name, speaking=False)

    def _send(self, name: str, item: Wire) -> None:
        super()._send(name, item)
        self._relay(name, item)  # a muted channel's audio never gets here (ChannelHub.mirror)

    def is_speaking(self, name: str) -> bool:
        return super().is_speaking(name) or name in self._remote_speakers

    # ---- ownership ---------------------------------------------------------------------------------

    def _owner_key(self, name: str) -> str:
        return self.link.key("owner", name)

    def _release_later(self, name: str, mine: str, then: Callable[[], None] = lambda: None) -> None:
        async def release() -> None:
            try:
                with contextlib.suppress(RedisLost):  # then the key expires by itself
                    await self.link.call("release", lambda r: self._release(keys=[self._owner_key(name)], args=[mine], client=r))
            finally:
                then()

        task = asyncio.create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _keep_owned(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._keep_now.wait(), self.owner_ttl_s / 3)
            self._keep_now.clear()
            if self._owned and self.link.up:
                with contextlib.suppress(RedisLost):  # renewed once Redis is back
                    await self._renew(list(self._owned.items()))

    async def _renew(self, owned: list[tuple[str, str]]) -> None:
        keys = [self._owner_key(name) for name, _ in owned]
        args = [*(mine for _, mine in owned), int(self.owner_ttl_s * 1000)]
        kept = await self.link.call("keep", lambda r: self._keep(keys=keys, args=args, client=r))
        for (name, mine), ok in zip(owned, kept):
            if self._owned.get(name) != mine:
                self._release_later(name, mine)  # its speaker left while we renewed it
            elif not ok:
                self._lose(name)

    def _lose(self, name: str) -> None:
        """Another session owns our speaker's channel now (ours was cut off from Redis past the TTL)."""
        log.warning("channel %r: its owner key was taken while this server could not renew it; its speaker here stops "
                    "speaking on it", name)
        self.claims.labels("lost").inc()
        self._owned.pop(name, None)
        channel = self._channels.get(name)
        if channel is not None and channel.speaker is not None:
            self._unseat(name, "claimed_elsewhere")
            self._forget_if_empty(name)

    def _announce(self, name: str, speaking: bool) -> None:
        """Tell the other servers (the newest speaker wins there too) and their listeners."""
        claim = json.dumps({"channel": name, "instance": self.link.instance, "speaking": speaking})
        self._queue(self.link.key("speakers"), claim.encode())
        self._relay(name, json.dumps(protocol.event("channel.speaker", channel=name, speaking=speaking)))

    def _relay(self, name: str, item: Wire) -> None:
        kind, payload = (AUDIO, item) if isinstance(item, bytes) else (TEXT, item.encode())
        self._queue(self.link.key("ch", name), self._me + kind + payload)

    def _queue(self, channel: str, data: bytes) -> None:
        if not self.link.up:
            self.relay_dropped.labels("redis_lost").inc()
            return
        try:
            self._outgoing.put_nowait((channel, data))
        except asyncio.QueueFull:
            self.relay_dropped.labels("queue_full").inc()

    async def _publish(self) -> None:
        while True:
            batch = [await self._outgoing.get()]
            while len(batch) < PUBLISH_BATCH_MAX and not self._outgoing.empty():
                batch.append(self._outgoing.get_nowait())

            async def send(redis, batch=batch):
                async with redis.pipeline(transaction=False) as pipe:
                    for channel, data in batch:
                        pipe.publish(channel, data)
                    return await pipe.execute()

            try:
                await self.link.call("publish", send)
                self.relayed.labels("out").inc(len(batch))
            except RedisLost:
                self.relay_dropped.labels("redis_lost").inc(len(batch))

    # ---- the operator's mute, the cluster's ------------------------------------------------------

    async def set_muted(self, name: str, muted: bool) -> None:
        self._mark_muted(name, muted)  # this server's listeners at once, whatever Redis says

        async def write(redis):
            async with redis.pipeline(transaction=True) as pipe:
                (pipe.sadd if muted else pipe.srem)(self.link.key("muted"), name)
                pipe.publish(self.link.key("mute"), json.dumps({"channel": name, "muted": muted}))
                return await pipe.execute()

        try:
            await self.link.call("mute", write)
        except RedisLost:
            raise ChannelRefused(CLUSTER_UNAVAILABLE, f"lost the cluster's Redis: channel {name!r} is "
                                 f"{'muted' if muted else 'unmuted'} on this server only; once Redis is back the "
                                 "cluster's mutes hold again, without this change: make it again then") from None

    def _on_mute(self, _: str, data: bytes) -> None:
        change = json.loads(data)
        self._mark_muted(change["channel"], change["muted"])

    async def _load_mutes(self) -> None:
        with contextlib.suppress(RedisLost):  # read again when Redis is back
            muted = await self.link.call("mutes", lambda r: r.smembers(self.link.key("muted")))
            self._muted = {name.decode() for name in muted}

    # ---- the listeners' side ---------------------------------------------------------------------

    def _on_channel(self, redis_channel: str, data: bytes) -> None:
        name = redis_channel[len(self._channel_prefix):]
        if data[:INSTANCE_LEN] == self._me:
            return  # ours: local listeners already have it
        channel = self._channels.get(name)
        if channel is None:
            return
        kind, payload = data[INSTANCE_LEN:INSTANCE_LEN + 1], data[INSTANCE_LEN + 1:]
        item: Wire = payload if kind == AUDIO else payload.decode()
        self.relayed.labels("in").inc()
        if self._silenced(name, item):
            return  # published before the mute reached the speaker's server
        for listener in list(channel.listeners):
            if not listener.offer(item):
                self._drop(name, listener)

    def _on_speaker(self, _: str, data: bytes) -> None:
        claim = json.loads(data)
        name, instance = claim["channel"], claim["instance"]
        if instance == self.link.instance:
            return
        if claim["speaking"]:
            self._remote_speakers[name] = instance
            # A newer session speaks on another server: ours stops speaking here and is told (its
            # listeners hear the new speaker's channel.speaker event).
            channel = self._channels.get(name)
            if channel is not None and channel.speaker is not None:
                self._owned.pop(name, None)  # the owner key is the new speaker's
                self._unseat(name, "claimed_elsewhere")
                self._forget_if_empty(name)
        elif self._remote_speakers.get(name) == instance:
            del self._remote_speakers[name]

    def _on_link_change(self, up: bool) -> None:
        if up:
            self._keep_now.set()
            loading = asyncio.create_task(self._load_mutes(), name="channel-mutes")
            self._mutes_loading.add(loading)
            loading.add_done_callback(self._mutes_loading.discard)
            for name, channel in self._channels.items():
                if channel.speaker is not None:
                    self._announce(name, speaking=True)
            return
        self._remote_speakers.clear()  # unknown until Redis is back
        lost = json.dumps(protocol.error(
            CLUSTER_UNAVAILABLE, "lost the cluster's Redis: until it is back you hear only speakers on this server"))
        for name, channel in list(self._channels.items()):
            for listener in list(channel.listeners):
                if not listener.offer(lost):
                    self._drop(name, listener)
