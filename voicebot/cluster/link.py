"""One process's connection to Redis: calls that give up fast, pub/sub, and losing Redis and finding it again.

Every command goes through `call`, which counts it (voicebot_cluster_redis_calls_total{op}: one
round trip each) and turns any failure into `RedisLost`. The first failure takes the link down
(voicebot_cluster_redis_up 0, voicebot_cluster_redis_errors_total{op}, the `on_change` callbacks):
callers then work with what this process holds, and a PING is tried every
`cluster.reconnect_interval_s` until one answers. Subscriptions live here, so a new connection
makes them again (pattern subscriptions, made once before start: no per-channel subscribe to race
with the first messages); their handlers run on the event loop and must not wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Awaitable, Callable, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from voicebot.config.server import ClusterConfig

log = logging.getLogger("voicebot.cluster")

# The `error` code sent to sessions and listeners when Redis is lost.
CLUSTER_UNAVAILABLE = "cluster_unavailable"

T = TypeVar("T")
Handler = Callable[[str, bytes], None]  # (channel, data)


class ClusterUnavailable(Exception):
    """The configured Redis does not answer at start-up."""


class RedisLost(Exception):
    """A Redis call failed, or the link is down: use what this process has."""


class RedisLink:
    def __init__(self, config: ClusterConfig, registry: CollectorRegistry) -> None:
        assert config.redis_url, "a RedisLink needs cluster.redis_url"
        self.url = config.redis_url
        self.prefix = config.key_prefix
        self.timeout_s = config.timeout_s
        self.reconnect_interval_s = config.reconnect_interval_s
        # Tags what this process publishes, so it can skip its own messages.
        self.instance = uuid.uuid4().hex
        # No retries inside redis-py: a failure must surface at once, and the reconnect loop retries.
        self.redis = Redis.from_url(self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                                    retry=Retry(NoBackoff(), 0))
        self.up = False
        self._handlers: dict[str, Handler] = {}
        self._pubsub = None
        self._reader: asyncio.Task | None = None
        self._reconnecting: asyncio.Task | None = None
        self._on_change: list[Callable[[bool], None]] = []
        self.up_gauge = Gauge("voicebot_cluster_redis_up", "1 while this server reaches its Redis", registry=registry)
        self.calls = Counter("voicebot_cluster_redis_calls_total", "Redis round trips, by operation", ["op"], registry=registry)
        self.errors = Counter("voicebot_cluster_redis_errors_total", "Failed Redis round trips, by operation", ["op"], registry=registry)

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def on_change(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(up)` whenever the link goes down or comes back."""
        self._on_change.append(callback)

    async def start(self) -> None:
        try:
            await asyncio.wait_for(self.redis.ping(), self.timeout_s)
            await self._open_pubsub()
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise ClusterUnavailable(
                f"cluster.redis_url {self.url}: Redis does not answer ({type(exc).__name__}: {exc}); "
                "start it, or remove cluster.redis_url to run this server on its own") from exc
        self._set_up(True)

    async def close(self) -> None:
        tasks = [t for t in (self._reader, self._reconnecting) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            if self._pubsub is not None:
                await self._pubsub.aclose()
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    async def call(self, op: str, command: Callable[[Redis], Awaitable[T]]) -> T:
        """Run one Redis command (or pipeline) within the timeout; RedisLost if it fails or the link is down."""
        if not self.up:
            raise RedisLost(f"Redis at {self.url} is unreachable")
        self.calls.labels(op).inc()
        try:
            return await asyncio.wait_for(command(self.redis), self.timeout_s)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._lost(op, exc)
            raise RedisLost(f"Redis at {self.url}: {type(exc).__name__}: {exc}") from exc

    # ---- pub/sub ---------------------------------------------------------------------------------

    def subscribe(self, pattern: str, handler: Handler) -> None:
        """Deliver every message published on a channel matching `pattern` (Redis PSUBSCRIBE
        syntax) to `handler(channel, data)`. Made before `start`, so nothing is missed from then on."""
        assert self._pubsub is None, "subscribe before start()"
        self._handlers[pattern] = handler

    async def _open_pubsub(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        if self._handlers:
            await asyncio.wait_for(self._pubsub.psubscribe(*self._handlers), self.timeout_s)
        self._reader = asyncio.create_task(self._read(self._pubsub), name="redis-pubsub")

    async def _read(self, pubsub) -> None:
        while True:
            try:
                message = await pubsub.get_message(timeout=1.0)
            except (RedisError, OSError) as exc:
                self._lost("subscribe", exc)
                return
            if message is None or message["type"] != "pmessage":
                continue
            handler = self._handlers.get(message["pattern"].decode())
            if handler is not None:
                try:
                    handler(message["channel"].decode(), message["data"])
                except Exception:  # one bad message must not stop every channel
                    log.exception("cluster: handling a message on %s failed", message["channel"])

    # ---- up and down -----------------------------------------------------------------------------

    def _lost(self, op: str, exc: BaseException) -> None:
        self.errors.labels(op).inc()
        if not self.up:
            return
        log.error("cluster: lost Redis at %s (%s: %s): conversations and channels stay on this server until it is back",
                  self.url, type(exc).__name__, exc)
        self._set_up(False)
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._reconnecting = asyncio.create_task(self._reconnect(), name="redis-reconnect")

    async def _reconnect(self) -> None:
        # Every pooled connection was to the Redis that went away: dropped, so that the first calls
        # once it is back (several at once: renewals, the muted set, publishing) do not each find a
        # dead socket and take the link down again.
        with contextlib.suppress(Exception):
            await self.redis.connection_pool.disconnect()
        while True:
            await asyncio.sleep(self.reconnect_interval_s)
            try:
                await asyncio.wait_for(self.redis.ping(), self.timeout_s)
                await self._open_pubsub()
            except (RedisError, OSError, asyncio.TimeoutError):
                continue
            log.info("cluster: Redis at %s is back", self.url)
            self._set_up(True)
            return

    def _set_up(self, up: bool) -> None:
        self.up = up
        self.up_gauge.set(1 if up else 0)
        for callback in self._on_change:
            try:
                callback(up)
            except Exception:
                log.exception("cluster: a link state callback failed")
