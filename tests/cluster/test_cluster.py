"""Three voicebot processes behind the shipped HAProxy config, sharing a real redis-server, on 127.0.0.1.

Every process here is real: redis-server, haproxy (deploy/haproxy/haproxy.cfg as shipped) and
run_server.py, each with its own temporary config and free port; the character's replies come
from the local chat-completions test server, which records what each server asked it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass

import pytest
import websockets

from tests.cluster.processes import HAProxy, RedisServer, VoicebotServer, free_port, start_behind_haproxy, wait_until
from tests.conftest import TEST_PHRASES, VoiceClient, speech_pcm
from tests.reply.sse_server import Behaviour, SSEServer

REPLY_CHUNKS = ["Nice", " to", " hear", " from", " you", "."]
LONG_SAY = "This reply is long enough to still be playing when the server is told to stop, and it must be heard to its end."


@dataclass
class Cluster:
    redis: RedisServer
    servers: list[VoicebotServer]
    lb: HAProxy
    model: SSEServer

    def sessions_per_server(self) -> list[int]:
        return [int(s.metric("voicebot_active_sessions")) for s in self.servers if s.alive()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cluster")
    model = SSEServer().start()
    model.default = Behaviour(chunks=REPLY_CHUNKS)
    redis = RedisServer(workdir).start()
    responder = {"engine": "openai", "openai": {"base_url": model.base_url, "model": "test"}}
    servers = [VoicebotServer(workdir, f"voicebot{i}", redis.url, reply=responder) for i in (1, 2, 3)]
    lb = None
    try:
        lb = start_behind_haproxy(workdir, servers)
        yield Cluster(redis, servers, lb, model)
    finally:
        for process in (lb, *servers, redis):
            if process is not None:
                process.stop()
        model.stop()


def wait_sessions(cluster: Cluster, expected: list[int], timeout_s: float = 10) -> None:
    seen: list[list[int]] = []
    try:
        wait_until(lambda: seen.append(cluster.sessions_per_server()) or seen[-1] == expected, timeout_s, "")
    except TimeoutError:
        raise AssertionError(f"sessions per server: {seen[-1]}, expected {expected}; {cluster.lb.servers_up()}") from None


async def connect_resuming(url: str, resume_token: str, timeout_s: float = 30):
    """Reconnect as a client does after its server went away: retry until a server takes the session
    (a refused connection, or a draining server's `shutting_down`, means try again)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stack = contextlib.AsyncExitStack()
        try:
            client = await stack.enter_async_context(VoiceClient.connect(url, send_start=False))
            await client.send({"type": "session.start", "resume": resume_token})
            for _ in range(200):
                if client.events or client.ws.close_code is not None:
                    break
                await asyncio.sleep(0.025)
            if client.events and client.events[0]["type"] == "session.ready":
                return stack, client
        except (OSError, websockets.WebSocketException):
            pass
        await stack.aclose()
        if time.monotonic() > deadline:
            raise AssertionError(f"no server took the resumed session within {timeout_s} s")
        await asyncio.sleep(0.25)  # within haproxy.cfg's limit of new connections per client


def test_clients_through_haproxy_spread_over_every_server(cluster):
    async def run():
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(VoiceClient.connect(cluster.lb.ws_url)) for _ in range(6)]
            await asyncio.to_thread(wait_sessions, cluster, [2, 2, 2])
            return [c.of_type("session.ready")[0]["session_id"] for c in clients]

    ids = asyncio.run(run())  # least connections: 2, 2 and 2 (wait_sessions fails otherwise)
    assert len(set(ids)) == 6
    wait_sessions(cluster, [0, 0, 0])


def test_a_listener_on_one_server_hears_the_speaker_on_another(cluster):
    one, two = cluster.servers[0], cluster.servers[1]

    async def run():
        async with VoiceClient.connect(f"{one.ws_url}?role=listener&channel=show", send_start=False) as listener:
            await listener.wait_for("listener.ready")
            async with VoiceClient.connect(two.ws_url, channel="show") as speaker:
                await speaker.send({"type": "say", "text": "Hello to everyone watching on the other server."})
                end = await speaker.wait_for("audio.end")
                heard_end = await listener.wait_for("audio.end", reply_id=end["reply_id"])
            await listener.wait_for("channel.speaker", speaking=False)
            return speaker, listener, end, heard_end

    speaker, listener, end, heard_end = asyncio.run(run())
    assert heard_end == end
    sent = speaker.reply_frames(end["reply_id"])
    assert len(sent) == end["frames"] > 0
    assert listener.reply_frames(end["reply_id"]) == sent, ([r for r, _ in listener.frames], [e["type"] for e in listener.events])  # every frame, in order, byte for byte
    relayed = [e for e in listener.events if e["type"] not in ("listener.ready", "channel.speaker")]
    private = {"session_id", "resume_token"}  # never sent to listeners (tests/integration/test_security.py)
    # session.ready included, as on a single server
    assert relayed == [{k: v for k, v in e.items() if k not in private} for e in speaker.events]
    assert [e["speaking"] for e in listener.of_type("channel.speaker")] == [True, False]
    assert two.metric("voicebot_cluster_relay_dropped_total", 'reason="queue_full"') == 0
    assert two.metric("voicebot_cluster_relay_dropped_total", 'reason="redis_lost"') == 0


def test_a_configured_redis_that_is_down_stops_start_up_with_a_clear_error(tmp_path):
    server = VoicebotServer(tmp_path, "no-redis", f"redis://127.0.0.1:{free_port()}/0").start()
    try:
        server.proc.wait(120)
    finally:
        server.stop()
    assert server.proc.returncode != 0
    assert "Redis does not answer" in server.log() and "remove cluster.redis_url" in server.log()


def test_sigterm_mid_conversation_the_client_resumes_on_another_server(cluster):
    """Turn 1 on one server; SIGTERM while a reply plays (it plays to its end); the client reconnects
    through HAProxy with resume, lands on another server, and turn 2's request carries turn 1."""
    cluster.model.reset(default=Behaviour(chunks=REPLY_CHUNKS))

    async def run():
        async with VoiceClient.connect(cluster.lb.ws_url) as first:
            await asyncio.to_thread(wait_until, lambda: sorted(cluster.sessions_per_server()) == [0, 0, 1], 10, "one session")
            home = next(s for s in cluster.servers if s.metric("voicebot_active_sessions") == 1)
            await first.stream(speech_pcm(TEST_PHRASES[1]), speed=2)
            turn1 = await first.wait_for("audio.end")
            await first.send({"type": "say", "text": LONG_SAY})
            playing = await first.wait_for("audio.start", count=2)
            home.signal(signal.SIGTERM)
            drained = await first.wait_for("audio.end", count=2)
            await asyncio.wait_for(first.ws.wait_closed(), 30)
        stack, second = await connect_resuming(cluster.lb.ws_url, first.of_type("session.ready")[0]["resume_token"])
        async with stack:
            landed = next(s for s in cluster.servers if s.alive() and s.metric("voicebot_active_sessions") == 1)
            await second.stream(speech_pcm(TEST_PHRASES[2]), speed=2)
            turn2 = await second.wait_for("audio.end")
        return first, home, landed, turn1, playing, drained, second, turn2

    first, home, landed, turn1, playing, drained, second, turn2 = asyncio.run(run())
    # Nothing the protocol promises was lost: each reply's frames, all of them, the one that was
    # playing at SIGTERM included; then the server left.
    assert len(first.reply_frames(turn1["reply_id"])) == turn1["frames"] > 0
    assert drained["reply_id"] == playing["reply_id"]
    assert len(first.reply_frames(playing["reply_id"])) == drained["frames"] > 0
    assert home.proc.wait(30) in (0, -signal.SIGTERM)
    # Another server took the client, with its conversation.
    assert landed is not home
    assert second.of_type("session.ready")[0]["resumed"] is True, home.log()[-3000:] + landed.log()[-2000:]
    assert len(second.reply_frames(turn2["reply_id"])) == turn2["frames"] > 0
    turn1_request, turn2_request = cluster.model.requests[-2:]
    said = turn1_request["body"]["messages"][-1]
    assert said["role"] == "user" and said["content"]
    history = [m for m in turn2_request["body"]["messages"] if m["role"] != "system"]
    assert history[:2] == [said, {"role": "assistant", "content": "".join(REPLY_CHUNKS)}]


def test_redis_going_away_leaves_the_server_working_alone_with_an_error_event(tmp_path):
    redis = RedisServer(tmp_path).start()
    server = VoicebotServer(tmp_path, "alone", redis.url).start()
    try:
        server.wait_ready()

        async def run():
            async with VoiceClient.connect(server.ws_url) as client:
                redis.stop()
                lost = await client.wait_for("error", code="cluster_unavailable", timeout=15)
                down = await asyncio.to_thread(server.metric, "voicebot_cluster_redis_up")
                await client.send({"type": "say", "text": "Still here without Redis."})
                end = await client.wait_for("audio.end")
                redis.start()
                await asyncio.to_thread(wait_until, lambda: server.metric("voicebot_cluster_redis_up") == 1, 15, "Redis back")
                return lost, down, end, client

        lost, down, end, client = asyncio.run(run())
    finally:
        server.stop()
        redis.stop()
    assert down == 0
    assert len(client.reply_frames(end["reply_id"])) == end["frames"] > 0
    assert "Redis" in lost["message"]
    assert server.proc.returncode in (0, -signal.SIGTERM)
