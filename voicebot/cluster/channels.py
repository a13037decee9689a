"""Channels across servers: a listener on one server hears the speaker on another, through Redis pub/sub.

Fan-out rather than routing each channel to one server (docs/deploy.md says why): every connection
may land anywhere, and the load balancer stays on least connections.

    {prefix}ch:{name}   what the channel's speaker is sent: instance id (32 hex) + b"t" text | b"b" audio, + payload
    {prefix}speakers    JSON {channel, instance, speaking}: who speaks where, so the newest speaker wins cluster-wide

Listeners on the speaker's own server are served directly, as on a single server. Every server
subscribes to every channel with one pattern subscription made at start-up, so a listener hears its
channel from its first moment; a server passes on only the channels it has listeners for (each
receives all speaking channels: 48 KB/s of audio each). Publishing never waits: messages queue
(bounded) for one publisher task, and what cannot be published (queue full, Redis lost) is counted
in voicebot_cluster_relay_dropped_total{reason}. While Redis is lost each server's channels are local.
"""

from __future__ import annotations

import asyncio
import json

from prometheus_client import Counter

from voicebot import protocol
from voicebot.channels import ChannelHub
from voicebot.cluster.link import CLUSTER_UNAVAILABLE, RedisLink, RedisLost
from voicebot.metrics import Metrics
from voicebot.transport import Wire

# Messages waiting to be published, all channels together: 256 x 9.6 KB frames = 2.4 MB at most,
# about 50 s of one channel's audio. Full means Redis is far slower than real time.
PUBLISH_QUEUE_MAX = 256
# Messages sent in one pipeline (one round trip).
PUBLISH_BATCH_MAX = 32
INSTANCE_LEN = 32
TEXT, AUDIO = b"t", b"b"


class ClusterChannelHub(ChannelHub):
    def __init__(self, metrics: Metrics, max_listeners: int, link: RedisLink) -> None:
        super().__init__(metrics, max_listeners)
        self.link = link
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
        link.on_change(self._on_link_change)

    def start(self) -> None:
        self._publisher = asyncio.create_task(self._publish(), name="channel-publisher")

    async def close(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            await asyncio.gather(self._publisher, return_exceptions=True)

    # ---- the speaker's side ----------------------------------------------------------------------

    def speak(self, name: str, session_id: str) -> None:
        super().speak(name, session_id)
        self._remote_speakers.pop(name, None)
        self._announce(name, speaking=True)

    def leave(self, session_id: str) -> None:
        name = self._speaking.get(session_id)
        super().leave(session_id)
        if name is not None:
            self._announce(name, speaking=False)

    def mirror(self, session_id: str, item: Wire) -> None:
        super().mirror(session_id, item)
        name = self._speaking.get(session_id)
        if name is not None:
            self._relay(name, item)

    def is_speaking(self, name: str) -> bool:
        return super().is_speaking(name) or name in self._remote_speakers

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
            # A newer session speaks on another server: ours stops speaking here, quietly (its
            # listeners hear the new speaker's channel.speaker event instead).
            channel = self._channels.get(name)
            if channel is not None and channel.speaker is not None:
                self._speaking.pop(channel.speaker, None)
                channel.speaker = None
                self._forget_if_empty(name)
        elif self._remote_speakers.get(name) == instance:
            del self._remote_speakers[name]

    def _on_link_change(self, up: bool) -> None:
        if up:
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
