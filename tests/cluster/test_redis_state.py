"""The Redis-backed conversation store and channel hub against a real redis-server, Redis going away included."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.cluster.processes import RedisServer, free_port
from voicebot.channels import ChannelRefused, Listener
from voicebot.cluster import CLUSTER_UNAVAILABLE, Cluster, ClusterUnavailable
from voicebot.config import load_settings
from voicebot.metrics import Metrics


def settings_for(url: str, owner_ttl_s: float = 10.0, **reply):
    return load_settings(None, cluster={"redis_url": url, "reconnect_interval_s": 0.1, "resume_wait_s": 1.0,
                                        "channel_owner_ttl_s": owner_ttl_s},
                         reply={"max_history_turns": 5, **reply})


def sample(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def started(url: str, owner_ttl_s: float = 10.0, **reply) -> tuple[Cluster, Metrics]:
    metrics = Metrics()
    cluster = Cluster(settings_for(url, owner_ttl_s, **reply), metrics)
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


class Told:
    """A speaker's `tell`: the error events it was sent, as (code, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    async def __call__(self, code: str, message: str, **fields) -> None:
        self.events.append((code, {"message": message, **fields}))


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
            await a.channels.claim("show", "speaker-1", owner="token-1")
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


def test_a_channel_has_one_owner_across_servers_and_only_its_resume_takes_it_over(redis_server):
    async def run():
        a, metrics_a = await started(redis_server.url, owner_ttl_s=1.5)
        b, metrics_b = await started(redis_server.url, owner_ttl_s=1.5)
        try:
            host_told = Told()
            await a.channels.claim("show", "host", owner="host-token", tell=host_told)
            await asyncio.sleep(2.0)  # past the owner key's TTL: a renews it while its speaker is connected
            with pytest.raises(ChannelRefused) as stranger:
                await b.channels.claim("show", "stranger", owner="stranger-token")
            still_a = a.channels._speaking.copy()
            # The host's client reconnects to b before a has seen its old socket close.
            await b.channels.claim("show", "host-again", owner="host-token-2", resumed_from="host-token")
            await eventually(lambda: not a.channels._speaking)
            await eventually(lambda: host_told.events)  # the old session is told it lost the channel
            a.channels.leave("host")  # the old socket closes at last: that frees nothing
            await a.channels.flush_releases()
            with pytest.raises(ChannelRefused):
                await a.channels.claim("show", "stranger", owner="stranger-token")
            b.channels.leave("host-again")  # the owner has gone: the next claim speaks
            await b.channels.flush_releases()
            await a.channels.claim("show", "next", owner="next-token")
            return (stranger.value.code, still_a, a.channels._speaking.copy(),
                    sample(metrics_b, "voicebot_cluster_channel_claims_total", outcome="taken"),
                    sample(metrics_a, "voicebot_cluster_channel_claims_total", outcome="granted"),
                    host_told.events, sample(metrics_a, "voicebot_channel_speakers_lost_total", reason="claimed_elsewhere"))
        finally:
            await a.close()
            await b.close()

    refused, still_a, now_a, taken_b, granted_a, told, lost = asyncio.run(run())
    assert [(code, fields["channel"], fields["reason"]) for code, fields in told] == [("channel_lost", "show", "claimed_elsewhere")]
    assert lost == 1
    assert refused == "channel_taken"
    assert still_a == {"host": "show"}
    assert now_a == {"next": "show"}
    assert taken_b == 1 and granted_a == 2


def test_a_listener_told_its_channel_is_free_can_have_it_taken_at_once(redis_server):
    """The speaker's own server tells its listeners the channel is free only once the owner key is
    released in Redis: told sooner, an overlay's operator who connected a new host on another server
    at that moment was refused channel_taken (test_channel_owner failed so in CI)."""
    async def run():
        a, _ = await started(redis_server.url)
        b, _ = await started(redis_server.url)
        try:
            listener = Listener(send_text=None, send_bytes=None)  # read straight from its queue
            assert b.channels.add_listener("show", listener)
            await b.channels.claim("show", "host", owner="host-token")
            call = b.link.call

            async def slow_release(op, command):
                if op == "release":
                    await asyncio.sleep(0.5)  # a Redis round trip the loop waits on
                return await call(op, command)

            b.link.call = slow_release
            b.channels.leave("host")
            for _ in range(10):
                event = json.loads(await asyncio.wait_for(listener.queue.get(), 5))
                if event == {"type": "channel.speaker", "channel": "show", "speaking": False}:
                    break
            else:
                raise AssertionError("the listener was never told the channel is free")
            await a.channels.claim("show", "next", owner="next-token")  # raised ChannelRefused before
            return a.channels._speaking.copy()
        finally:
            await a.close()
            await b.close()

    assert asyncio.run(run()) == {"next": "show"}


def test_a_crashed_servers_channel_is_free_after_the_owner_ttl(redis_server):
    async def run():
        a, _ = await started(redis_server.url, owner_ttl_s=2.0)
        b, _ = await started(redis_server.url, owner_ttl_s=2.0)
        try:
            await a.channels.claim("show", "host", owner="host-token")
            await a.channels.close()  # a stops renewing, as a crashed server would, its speaker never leaving
            with pytest.raises(ChannelRefused):
                await b.channels.claim("show", "stranger", owner="stranger-token")
            await asyncio.sleep(2.5)
            await b.channels.claim("show", "stranger", owner="stranger-token")
            return b.channels._speaking.copy()
        finally:
            await a.close()
            await b.close()

    assert asyncio.run(run()) == {"stranger": "show"}


def test_without_redis_no_one_claims_a_channel_and_speakers_keep_theirs(tmp_path):
    redis = RedisServer(tmp_path).start()

    async def run():
        a, metrics_a = await started(redis.url, owner_ttl_s=2.0)
        b, _ = await started(redis.url, owner_ttl_s=2.0)
        try:
            await a.channels.claim("show", "host", owner="host-token")
            redis.stop()
            with pytest.raises(ChannelRefused) as lost:
                await b.channels.claim("show", "stranger", owner="stranger-token")
            await eventually(lambda: not a.link.up and not b.link.up)
            with pytest.raises(ChannelRefused) as also_lost:
                await b.channels.claim("other", "someone", owner="someone-token")
            kept = a.channels._speaking.copy()
            redis.start()  # empty: every key was lost with it
            await eventually(lambda: a.link.up and b.link.up, timeout_s=10)
            owner = None
            for _ in range(100):  # a takes its speaker's key again
                if (owner := await a.link.redis.get(a.link.key("owner", "show"))) is not None:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(ChannelRefused) as after:
                await b.channels.claim("show", "stranger", owner="stranger-token")
            return (lost.value.code, also_lost.value.code, kept, owner, after.value.code,
                    sample(metrics_a, "voicebot_cluster_channel_claims_total", outcome="lost"))
        finally:
            await a.close()
            await b.close()

    try:
        lost, also_lost, kept, owner, after, lost_claims = asyncio.run(run())
    finally:
        redis.stop()
    assert lost == also_lost == CLUSTER_UNAVAILABLE
    assert kept == {"host": "show"}  # its speaker goes on, heard by a's own listeners
    assert owner is not None
    assert after == "channel_taken"
    assert lost_claims == 0


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
            await a.channels.claim("show", "speaker", owner="token")
            redis.stop()
            a.channels.mirror("speaker", json.dumps({"type": "reply.delta", "text": "hi"}))  # publishing fails: the link goes down
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


def test_a_speaker_whose_channel_was_taken_while_its_server_was_cut_off_stops_speaking(redis_server):
    async def run():
        a, metrics_a = await started(redis_server.url, owner_ttl_s=0.3)
        try:
            host_told = Told()
            await a.channels.claim("show", "host", owner="host-token", tell=host_told)
            # What Redis holds after a was cut off past the TTL and another server's session claimed it.
            await a.link.redis.set(a.link.key("owner", "show"), "0" * 32)
            await eventually(lambda: not a.channels._speaking)  # found at its next renewal
            await eventually(lambda: host_told.events)
            a.channels.leave("host")
            await a.channels.flush_releases()
            return (await a.link.redis.get(a.link.key("owner", "show")),
                    sample(metrics_a, "voicebot_cluster_channel_claims_total", outcome="lost"),
                    host_told.events, sample(metrics_a, "voicebot_channel_speakers_lost_total", reason="claimed_elsewhere"))
        finally:
            await a.close()

    owner, lost, told, speakers_lost = asyncio.run(run())
    assert owner == b"0" * 32  # the new owner's key stays
    assert lost == 1
    assert [(code, fields["reason"]) for code, fields in told] == [("channel_lost", "claimed_elsewhere")]
    assert "could not renew" in told[0][1]["message"] and speakers_lost == 1
