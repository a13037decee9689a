"""The operator's mute holds across the cluster: in-process servers sharing a real redis-server.

Muting a channel on any server mutes its reply audio for every listener on every server, whichever
server its speaker is on; a server that joins later finds it muted; the events still reach everyone.
Without Redis a mute holds on the server that made it, and the operator is told it holds there only.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.cluster.processes import RedisServer
from tests.cluster.test_redis_state import eventually, sample, started
from voicebot.channels import ChannelRefused, Listener
from voicebot.cluster import CLUSTER_UNAVAILABLE

FRAME = b"\x01\x02" * 4800
QUIET_S = 0.3  # how long a listener is watched for audio that must not come (a Redis round trip is ~1 ms)


def listening(cluster, name: str = "show") -> Listener:
    listener = Listener(send_text=None, send_bytes=None)  # read straight from its queue
    assert cluster.channels.add_listener(name, listener)
    return listener


def taken(listener: Listener) -> list:
    got = []
    while not listener.queue.empty():
        got.append(listener.queue.get_nowait())
    return got


def delta(text: str) -> str:
    return json.dumps({"type": "reply.delta", "reply_id": "r1", "text": text})


def texts(items: list) -> list[str]:
    return [json.loads(m)["text"] for m in items if isinstance(m, str) and json.loads(m)["type"] == "reply.delta"]


def test_a_mute_made_on_a_listeners_server_mutes_the_speaker_on_another_for_every_listener(redis_server):
    async def run():
        a, metrics_a = await started(redis_server.url)  # the speaker's server
        b, metrics_b = await started(redis_server.url)  # where the operator mutes it
        c = None
        try:
            here, there = listening(a), listening(b)
            await asyncio.sleep(0.2)  # the subscriptions are made in the background
            await a.channels.claim("show", "host", owner="host-token")
            a.channels.mirror("host", delta("before"))
            a.channels.mirror("host", FRAME)
            await eventually(lambda: FRAME in list(there.queue._queue))
            before = taken(here), taken(there)

            await b.channels.set_muted("show", True)
            a.channels.mirror("host", FRAME)  # maybe before the mute reached a: b drops it then
            await eventually(lambda: a.channels.describe()["show"]["muted"])
            a.channels.mirror("host", delta("muted"))
            a.channels.mirror("host", FRAME)
            await eventually(lambda: "muted" in texts(list(there.queue._queue)))
            await asyncio.sleep(QUIET_S)
            muted = taken(here), taken(there)
            c, _ = await started(redis_server.url)  # a server that joins finds the channel muted
            await eventually(lambda: "show" in c.channels.describe())  # it reads the cluster's mutes as it starts
            late_joiner = c.channels.describe()["show"]["muted"]

            await a.channels.set_muted("show", False)
            await eventually(lambda: not b.channels.describe()["show"]["muted"])
            await eventually(lambda: "show" not in c.channels.describe())  # no listener, not muted: not known there
            a.channels.mirror("host", FRAME)
            await eventually(lambda: FRAME in list(there.queue._queue))
            after = taken(here), taken(there)
            counted = (sample(metrics_a, "voicebot_channel_muted_frames_total")
                       + sample(metrics_b, "voicebot_channel_muted_frames_total"))
            return before, muted, after, late_joiner, counted
        finally:
            for cluster in (a, b, c):
                if cluster is not None:
                    await cluster.close()

    before, muted, after, late_joiner, counted = asyncio.run(run())
    for listener_got in before:
        assert texts(listener_got) == ["before"] and FRAME in listener_got
    for listener_got in muted:  # the events, but no audio, on both servers
        assert texts(listener_got) == ["muted"]
        assert not any(isinstance(m, bytes) for m in listener_got)
    assert late_joiner is True
    for listener_got in after:
        assert FRAME in listener_got
    # Every muted frame is counted once, where it stopped: not relayed (a), or dropped on arrival (b),
    # plus a's own listener's copy of the first one if a had not heard of the mute yet.
    assert 2 <= counted <= 3


def test_the_speakers_server_does_not_relay_a_muted_channels_audio(redis_server):
    async def run():
        a, metrics_a = await started(redis_server.url)
        b, metrics_b = await started(redis_server.url)
        try:
            there = listening(b)
            await asyncio.sleep(0.2)
            await a.channels.claim("show", "host", owner="host-token")
            await eventually(lambda: '"speaking": true' in "".join(map(str, there.queue._queue)))  # the claim, heard
            await a.channels.set_muted("show", True)
            await eventually(lambda: b.channels.describe()["show"]["muted"])
            in_before = sample(metrics_b, "voicebot_cluster_relayed_total", direction="in")
            for _ in range(5):
                a.channels.mirror("host", FRAME)
            a.channels.mirror("host", delta("still told"))
            await eventually(lambda: "still told" in texts(list(there.queue._queue)))
            arrived = sample(metrics_b, "voicebot_cluster_relayed_total", direction="in") - in_before
            return (taken(there), arrived, sample(metrics_a, "voicebot_channel_muted_frames_total"),
                    sample(metrics_b, "voicebot_channel_muted_frames_total"))
        finally:
            await a.close()
            await b.close()

    got, relayed_in, muted_at_speaker, muted_at_listener = asyncio.run(run())
    assert not any(isinstance(m, bytes) for m in got)
    assert relayed_in == 1  # the delta only (published after the frames): no frame went through Redis
    assert (muted_at_speaker, muted_at_listener) == (5, 0)


def test_without_redis_a_mute_holds_on_its_server_only_and_the_operator_is_told(tmp_path):
    redis = RedisServer(tmp_path).start()

    async def run():
        a, _ = await started(redis.url)
        try:
            here = listening(a)
            await a.channels.claim("show", "host", owner="host-token")
            redis.stop()
            with pytest.raises(ChannelRefused) as refused:
                await a.channels.set_muted("show", True)
            taken(here)
            a.channels.mirror("host", FRAME)
            return refused.value, taken(here), a.channels.describe()["show"]["muted"]
        finally:
            await a.close()

    try:
        refused, got, muted_here = asyncio.run(run())
    finally:
        redis.stop()
    assert refused.code == CLUSTER_UNAVAILABLE and "on this server only" in refused.message
    assert muted_here and FRAME not in got
