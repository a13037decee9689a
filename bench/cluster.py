"""Several voicebot servers behind HAProxy with Redis: spread, first audio, resume, Redis round trips.

    python bench/cluster.py [--servers 3] [--sessions 12] [--turns 20] [--rounds 20]

Starts redis-server, N voicebot servers (configs/default.yaml plus cluster.redis_url; the engines
are the stand-ins, so figures are the cluster's own overhead) and haproxy with
deploy/haproxy/haproxy.cfg as shipped (its per-client limits raised: every client here is
127.0.0.1), all on 127.0.0.1, then measures in one run:

- sessions per server: --sessions clients connect through HAProxy at once, each speaks a reply;
- first audio: `say` sent -> first reply frame received, direct to a server vs through HAProxy,
  alternating on two open sessions (p50/p95 of --turns each);
- reconnect and resume: socket closed -> `session.ready {resumed: true}` on the new socket, through
  HAProxy (lands anywhere) and direct to another server (always through Redis), reconnecting at
  once (the old server hands the conversation over) and a second later (it is in Redis already),
  --rounds each; and once after SIGTERM to the client's server, mid-reply (the drain included);
- Redis round trips (voicebot_cluster_redis_calls_total on every server, by operation) per turn,
  per turn on a channel with a listener on another server, and per reconnect-and-resume.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import websockets

ROOT = Path(__file__).resolve().parent.parent
import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.cluster.processes import HAProxy, RedisServer, VoicebotServer, start_behind_haproxy, wait_until  # noqa: E402

SHORT = "Thanks for the question."
LONG = "This answer goes on for a few seconds, so the server is still speaking it when it is told to stop."


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def row(name: str, values_ms: list[float]) -> str:
    return f"  {name:<50} p50 {pct(values_ms, 50):7.1f} ms   p95 {pct(values_ms, 95):7.1f} ms   (n={len(values_ms)})"


class Client:
    """The bare protocol, timed: session.start, say, and the first binary frame of the reply."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.ready: dict = {}

    @classmethod
    async def open(cls, url: str, **start) -> "Client":
        client = cls(await websockets.connect(url, max_size=None))
        await client.ws.send(json.dumps({"type": "session.start", **start}))
        client.ready = json.loads(await client.ws.recv())
        assert client.ready["type"] == "session.ready", client.ready
        return client

    async def say(self, text: str) -> tuple[float, int]:
        """Seconds from sending to the first frame, and the frames of the whole reply."""
        sent = time.perf_counter()
        await self.ws.send(json.dumps({"type": "say", "text": text}))
        first, frames = None, 0
        while True:
            message = await self.ws.recv()
            if isinstance(message, bytes):
                first = first or time.perf_counter()
                frames += 1
            elif json.loads(message)["type"] == "audio.end":
                end = json.loads(message)
                assert end["frames"] == frames, (end, frames)
                return first - sent, frames

    async def close(self) -> None:
        await self.ws.close()


def redis_calls(servers: list[VoicebotServer]) -> Counter:
    calls: Counter = Counter()
    for server in servers:
        if not server.alive():
            continue
        for line in server.get("/metrics").text.splitlines():
            if line.startswith("voicebot_cluster_redis_calls_total{"):
                op = line.split('op="')[1].split('"')[0]
                calls[op] += float(line.split()[-1])
    return calls


def per(after: Counter, before: Counter, count: int) -> str:
    delta = {op: (after[op] - before[op]) / count for op in sorted(after) if after[op] != before[op]}
    total = sum(delta.values())
    return f"{total:.2f}" + (f"  ({', '.join(f'{op} {v:.2f}' for op, v in delta.items())})" if delta else "")


async def resumed_at(url: str, resume_token: str, timeout_s: float = 30) -> tuple[Client, float]:
    """Reconnect until a server takes the session (a draining one refuses); when it was ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, websockets.WebSocketException, AssertionError):
            client = await Client.open(url, resume=resume_token)
            assert client.ready["resumed"], client.ready
            return client, time.perf_counter()
        if time.monotonic() > deadline:
            raise TimeoutError("no server resumed the session")
        await asyncio.sleep(0.05)


async def measure(servers: list[VoicebotServer], lb: HAProxy, args) -> None:
    print(f"\n{len(servers)} servers behind haproxy, Redis shared")

    # ---- sessions per server ----
    clients = await asyncio.gather(*(Client.open(lb.ws_url) for _ in range(args.sessions)))
    spread = [int(s.metric("voicebot_active_sessions")) for s in servers]
    replies = await asyncio.gather(*(c.say(SHORT) for c in clients))
    await asyncio.gather(*(c.close() for c in clients))
    print(f"sessions per server, {args.sessions} clients through haproxy at once: {spread} "
          f"(each spoke a reply: {sum(1 for _, frames in replies if frames)} / {args.sessions} complete)")
    await asyncio.to_thread(wait_until, lambda: all(s.metric("voicebot_active_sessions") == 0 for s in servers), 10, "sessions closed")

    # ---- first audio, direct vs through haproxy ----
    direct, through = await Client.open(servers[0].ws_url), await Client.open(lb.ws_url)
    before = redis_calls(servers)
    first = {"direct": [], "haproxy": []}
    for _ in range(args.turns):
        for name, client in (("direct", direct), ("haproxy", through)):
            first[name].append((await client.say(SHORT))[0] * 1000)
    turn_calls = per(redis_calls(servers), before, 2 * args.turns)
    await direct.close()
    await through.close()
    print("first audio (say sent -> first reply frame received):")
    print(row("direct to a server", first["direct"]))
    print(row("through haproxy", first["haproxy"]))

    # ---- a turn on a channel, heard on another server ----
    listener = await websockets.connect(f"{servers[1].ws_url}?role=listener&channel=bench", max_size=None)
    speaker = await Client.open(servers[0].ws_url, channel="bench")
    heard = asyncio.create_task(_count_frames(listener))
    before = redis_calls(servers)
    spoken = 0
    for _ in range(args.turns):
        spoken += (await speaker.say(SHORT))[1]
    await asyncio.sleep(0.5)
    channel_calls = per(redis_calls(servers), before, args.turns)
    await speaker.close()
    heard.cancel()
    await listener.close()
    print(f"channel relay: {args.turns} replies, {spoken} frames spoken on server 1, {heard_frames[0]} heard on server 2")

    # ---- reconnect and resume ----
    fresh = []
    for i in range(args.rounds):
        opened = time.perf_counter()
        client = await Client.open(lb.ws_url)
        fresh.append((time.perf_counter() - opened) * 1000)
        await client.close()
    # (route, seconds between the close and the reconnect): at once, the old server is still
    # closing the session and hands the conversation over; after a second it is already in Redis.
    resume = {("haproxy", 0): [], ("another server", 0): [], ("another server", 1): []}
    before = redis_calls(servers)
    for i in range(args.rounds):
        for name, pause_s in resume:
            first_url = lb.ws_url if name == "haproxy" else servers[i % len(servers)].ws_url
            again_url = lb.ws_url if name == "haproxy" else servers[(i + 1) % len(servers)].ws_url
            client = await Client.open(first_url)
            await client.say(SHORT)
            await client.close()
            await asyncio.sleep(pause_s)
            closed = time.perf_counter()
            again, ready = await resumed_at(again_url, client.ready["resume_token"])
            resume[name, pause_s].append((ready - closed) * 1000)
            await again.close()
    resume_calls = per(redis_calls(servers), before, len(resume) * args.rounds)
    print("reconnect and resume (socket closed -> session.ready resumed on the new one):")
    print(row("a new session, for comparison (connect -> ready)", fresh))
    print(row("through haproxy (any server), at once", resume["haproxy", 0]))
    print(row("direct to another server, at once", resume["another server", 0]))
    print(row("direct to another server, 1 s after the close", resume["another server", 1]))

    # ---- SIGTERM mid-reply ----
    client = await Client.open(lb.ws_url)
    home = next(s for s in servers if s.metric("voicebot_active_sessions") == 1)
    await client.ws.send(json.dumps({"type": "say", "text": LONG}))
    while not isinstance(await client.ws.recv(), bytes):
        pass
    home.signal(signal.SIGTERM)
    frames, end = 1, None
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            message = await client.ws.recv()
            if isinstance(message, bytes):
                frames += 1
            elif json.loads(message)["type"] == "audio.end":
                end = json.loads(message)
    closed = time.perf_counter()
    again, ready = await resumed_at(lb.ws_url, client.ready["resume_token"])
    await again.close()
    print(f"SIGTERM mid-reply: the reply played to its end ({frames} of {end and end['frames']} frames), "
          f"socket closed -> resumed on another server in {(ready - closed) * 1000:.0f} ms")

    print("Redis round trips:")
    print(f"  per turn (no channel)                        {turn_calls}")
    print(f"  per turn on a channel, listener elsewhere    {channel_calls}")
    print(f"  per session that closes and is resumed       {resume_calls}")


heard_frames = [0]


async def _count_frames(ws) -> None:
    async for message in ws:
        if isinstance(message, bytes):
            heard_frames[0] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        redis = RedisServer(workdir).start()
        servers = [VoicebotServer(workdir, f"voicebot{i}", redis.url, server={"max_sessions": args.sessions})
                   for i in range(1, args.servers + 1)]
        lb = None
        try:
            lb = start_behind_haproxy(workdir, servers, VOICEBOT_LB_CLIENT_CONNS="10000", VOICEBOT_LB_CLIENT_RATE="10000")
            asyncio.run(measure(servers, lb, args))
        finally:
            for process in (lb, *servers, redis):
                if process is not None:
                    process.stop()


if __name__ == "__main__":
    main()
