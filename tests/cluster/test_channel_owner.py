"""A channel has one speaker in the whole cluster: two real voicebot processes sharing a real redis-server.

A stranger on another server cannot take a channel whose speaker is connected; the speaker's own
client, reconnecting to another server with its resume token, can; a channel whose speaker has gone
is free. The overlay (a listener on the other server) hears only the channel's owner.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.cluster.processes import RedisServer, VoicebotServer
from tests.conftest import VoiceClient

OWNER_TTL_S = 1.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("owner")
    redis = RedisServer(workdir).start()
    pair = [VoicebotServer(workdir, f"owner{i}", redis.url, cluster={"channel_owner_ttl_s": OWNER_TTL_S}) for i in (1, 2)]
    try:
        for server in pair:
            server.start()
        for server in pair:
            server.wait_ready()
        yield pair
    finally:
        for process in (*pair, redis):
            process.stop()


async def say(client: VoiceClient, text: str, count: int) -> dict:
    await client.send({"type": "say", "text": text})
    return await client.wait_for("audio.end", count=count)


def test_only_the_owner_speaks_on_a_channel_across_servers(servers):
    one, two = servers

    async def run():
        async with contextlib.AsyncExitStack() as stack:
            overlay = await stack.enter_async_context(
                VoiceClient.connect(f"{two.ws_url}?role=listener&channel=show", send_start=False))
            await overlay.wait_for("listener.ready")
            host = await stack.enter_async_context(VoiceClient.connect(one.ws_url, channel="show"))
            await asyncio.sleep(3 * OWNER_TTL_S)  # the owner key outlives its TTL: one renews it
            stranger = await stack.enter_async_context(VoiceClient.connect(two.ws_url, channel="show"))
            refused = await stranger.wait_for("error", code="channel_taken")
            strangers = await say(stranger, "I am not the host.", 1)
            hosts = await say(host, "Welcome to the show.", 1)
            await overlay.wait_for("audio.end", reply_id=hosts["reply_id"])

            # The host's client comes back on the other server before its old socket is seen closed.
            token = host.of_type("session.ready")[0]["resume_token"]
            back = await stack.enter_async_context(VoiceClient.connect(two.ws_url, channel="show", resume=token))
            backs = await say(back, "I am back.", 1)
            await overlay.wait_for("audio.end", reply_id=backs["reply_id"])
            lost = await host.wait_for("error", code="channel_lost")  # the old session is told
            hosts_after = await say(host, "Still the old session.", 2)  # heard by its own client only
            await host.ws.close()  # the old socket closing frees nothing
            await asyncio.sleep(0.5)
            async with VoiceClient.connect(one.ws_url, channel="show") as late:
                await late.wait_for("error", code="channel_taken")
            await back.ws.close()  # the owner has gone: the channel is free
            await overlay.wait_for("channel.speaker", speaking=False, count=1)
            async with VoiceClient.connect(one.ws_url, channel="show") as next_host:
                nexts = await say(next_host, "My turn now.", 1)
                await overlay.wait_for("audio.end", reply_id=nexts["reply_id"])
                next_errors = next_host.of_type("error")
            return overlay, refused, strangers, back, next_errors, lost, hosts_after

    overlay, refused, strangers, back, next_errors, lost, hosts_after = asyncio.run(run())
    assert "has a speaker" in refused["message"]
    for silenced in (strangers, hosts_after):  # the overlay never played the stranger, nor the old session
        assert not overlay.reply_frames(silenced["reply_id"])
        assert not [e for e in overlay.events if e.get("reply_id") == silenced["reply_id"]]
    assert lost["channel"] == "show" and lost["reason"] == "claimed_elsewhere"
    assert one.metric("voicebot_channel_speakers_lost_total", 'reason="claimed_elsewhere"') == 1
    assert back.of_type("session.ready")[0]["resumed"] is True and not back.of_type("error")
    assert next_errors == []
    assert two.metric("voicebot_cluster_channel_claims_total", 'outcome="taken"') == 1
    assert one.metric("voicebot_cluster_channel_claims_total", 'outcome="taken"') == 1
