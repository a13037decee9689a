"""The Redis-backed conversation store and channel hub against a real redis-server, Redis going away included."""

from __future__ import annotations

import asyncio
import json

import pytest

from voicebot.channels import Listener
from voicebot.cluster import CLUSTER_UNAVAILABLE, Cluster, ClusterUnavailable
from voicebot.config import load_settings
from voicebot.metrics import Metrics
from tests.cluster.processes import RedisServer, free_port


def settings_for(url: str, **reply):
    return load_settings(None, cluster={"redis_url": url, "reconnect_interval_s": 0.1, "resume_wait_s": 1.0},
                         reply={"max_history_turns": 5, **reply})


def sample(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def started(url: str, **reply) -> tuple[Cluster, Metrics]:
    metrics = Metrics()
    cluster = Cluster(settings_for(url, **reply), metrics)
    await cluster.start()
    return cluster, metrics


async def eventually(check, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def conversation_of(cluster: Cluster, *turns: tuple[str, str]):
    conversation = cluster.conversations._new_conversation()
    for user, heard in turns:
        conversation.add_user(user)
        conversation.add_assistant(heard)
    return conversation


def test_a_conversation_released_on_one_server_is_taken_on_another_once(redis_server):
    async def run():
        a, _ = await started(redis_server.url)
        b, metrics_b = await started(redis_server.url)
        try:
            a.conversations.register("s1", conversation_of(a, ("hello", "hi there"), ("how are you", "fine")))
            a.conversations.release("s1")
            await a.conversations.flush()
            taken = await b.conversations.take("s1")
            again = await b.conversations.take("s1")
            return taken, again, sample(metrics_b, "voicebot_cluster_redis_calls_total", op="take")
        finally:
            await a.close()
            await b.close()

    taken, again, take_calls = asyncio.run(run())
    assert [m["content"] for m in taken.messages()] == ["hello", "hi there", "how are you", "fine"]
    assert again is None
    assert take_calls == 2  # one round trip each


def test_a_live_conversation_on_another_server_is_handed_over_on_resume(redis_server):
    """The client is back on server b before server a saw its old socket close."""

    async def run():
        a, _ = await started(redis_server.url)
        b, _ = await started(redis_server.url)
        try:
            a.conversations.register("s1", conversation_of(a, ("are you there", "yes")))
            await asyncio.sleep(0.1)  # the live mark is written in the background
            taken = await b.conversations.take("s1")
            a.conversations.release("s1")  # the old socket is finally seen closed: nothing left to keep
            await a.conversations.flush()
            return taken, await b.conversations.take("s1")
        finally:
            await a.close()
            await b.close()

    taken, again = asyncio.run(run())
    assert [m["content"] for m in taken.messages()] == ["are you there", "yes"]
    assert again is None


def test_released_conversations_expire_and_are_bounded_across_servers(redis_server):
    async def run():
        a, _ = await started(redis_server.url, resume_max_conversations=3, resume_ttl_s=0.5)
        try:
            for i in range(5):
                a.conversations.register(f"s{i}", conversation_of(a, (f"turn {i}", "ok")))
                a.conversations.release(f"s{i}")
                await a.conversations.flush()
            stored = await a.link.redis.keys(a.link.key("conv", "*"))
            oldest, newest = await a.conversations.take("s0"), await a.conversations.take("s4")
            a.conversations.register("late", conversation_of(a, ("late", "ok")))
            a.conversations.release("late")
            await a.conversations.flush()
            await asyncio.sleep(0.6)
            expired = await a.conversations.take("late")
            index = await a.link.redis.zcard(a.link.key("released"))
            return len(stored), oldest, newest, expired, index
        finally:
            await a.close()

    stored, oldest, newest, expired, index = asyncio.run(run())
    assert stored == 3
    assert oldest is None and newest is not None
    assert expired is None
    assert index <= 3


def test_an_unreachable_redis_stops_start_up_with_a_clear_error():
    async def run():
        cluster = Cluster(settings_for(f"redis://127.0.0.1:{free_port()}/0"), Metrics())
        try:
            await cluster.start()
        finally:
            await cluster.close()

    with pytest.raises(ClusterUnavailable, match="Redis does not answer.*remove cluster.redis_url"):
        asyncio.run(run())


def test_a_listener_on_one_server_hears_the_speaker_on_another(redis_server):
    async def run():
        a, _ = await started(redis_server.url)
        b, metrics_b = await started(redis_server.url)
        try:
            received: list = []

            async def collect(item):
                received.append(item)

            listener = Listener(collect, collect)
            assert b.channels.add_listener("show", listener)
            sender = asyncio.create_task(listener.run_sender())
            await asyncio.sleep(0.2)  # the subscription is made in the background
            a.channels.speak("show", "speaker-1")
            a.channels.mirror("speaker-1", json.dumps({"type": "reply.delta", "text": "hi"}))
            a.channels.mirror("speaker-1", b"\x01\x02" * 4800)
            await eventually(lambda: len(received) >= 4)
            speaking = b.channels.is_speaking("show")
            a.channels.leave("speaker-1")
            await eventually(lambda: len(received) >= 5)
            sender.cancel()
            return received, speaking, sample(metrics_b, "voicebot_cluster_relayed_total", direction="in")
        finally:
            await a.close()
            await b.close()

    received, speaking, relayed_in = asyncio.run(run())
    events = [json.loads(m) for m in received if isinstance(m, str)]
    assert [e["type"] for e in events] == ["listener.ready", "channel.speaker", "reply.delta", "channel.speaker"]
    assert [e.get("speaking") for e in events if e["type"] == "channel.speaker"] == [True, False]
    assert [m for m in received if isinstance(m, bytes)] == [b"\x01\x02" * 4800]
    assert speaking
    assert relayed_in == 4


def test_the_newest_speaker_wins_across_servers(redis_server):
    async def run():
        a, _ = await started(redis_server.url)
        b, _ = await started(redis_server.url)
        try:
            a.channels.speak("show", "old")
            await asyncio.sleep(0.1)
            b.channels.speak("show", "new")
            await eventually(lambda: not a.channels._speaking)
            return a.channels.is_speaking("show")
        finally:
            await a.close()
            await b.close()

    assert asyncio.run(run())  # a knows the channel still has a speaker: b's


def test_redis_going_away_degrades_to_local_then_recovers(tmp_path):
    redis = RedisServer(tmp_path).start()

    async def run():
        a, metrics = await started(redis.url)
        try:
            local: list = []

            async def collect(item):
                local.append(item)

            listener = Listener(collect, collect)
            a.channels.add_listener("show", listener)
            sender = asyncio.create_task(listener.run_sender())
            changes: list[bool] = []
            a.link.on_change(changes.append)
            redis.stop()
            a.channels.speak("show", "speaker")  # publishing fails: the link goes down
            a.channels.mirror("speaker", b"\x00\x01" * 4800)
            await eventually(lambda: changes == [False])
            # Local-only: the listener here still hears the speaker here; conversations stay here.
            a.conversations.register("s1", conversation_of(a, ("still here", "yes")))
            a.conversations.release("s1")
            kept = await a.conversations.take("s1")
            down = sample(metrics, "voicebot_cluster_redis_up")
            dropped = sample(metrics, "voicebot_cluster_relay_dropped_total", reason="redis_lost")
            redis.start()
            await eventually(lambda: changes == [False, True], timeout_s=10)
            a.conversations.register("s2", conversation_of(a, ("back", "yes")))
            a.conversations.release("s2")
            await a.conversations.flush()
            stored = await a.link.redis.exists(a.link.key("conv", "s2"))
            await eventually(lambda: any(isinstance(m, str) and CLUSTER_UNAVAILABLE in m for m in local))
            sender.cancel()
            return local, kept, down, dropped, stored, sample(metrics, "voicebot_cluster_redis_up")
        finally:
            await a.close()

    try:
        local, kept, down, dropped, stored, up = asyncio.run(run())
    finally:
        redis.stop()
    assert b"\x00\x01" * 4800 in local
    assert kept is not None and [m["content"] for m in kept.messages()] == ["still here", "yes"]
    assert down == 0 and up == 1
    assert dropped >= 1
    assert stored == 1
