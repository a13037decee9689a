"""Responder latency through the real server, read back from /metrics.

Starts the local chat-completions test server (tests/reply/sse_server.py) and the voice server
with the openai responder pointed at it, speaks N utterances over a WebSocket and prints
voicebot_reply_first_text_seconds and voicebot_reply_total_seconds (mean, and the bucket holding
the median and p90). `--first-ms` and `--token-ms` shape the fake model's timing; with both at 0
the figures are the pipeline's own overhead (HTTP, SSE parsing, the session's plumbing).

    python -m bench.responder --turns 20 [--first-ms 0 --token-ms 0 --tokens 12]
"""

from __future__ import annotations

import argparse
import asyncio
import re

import httpx
from websockets.asyncio.client import connect

from tests.integration.test_responder_server import PHRASES, Client, VoiceServer
from tests.reply.sse_server import Behaviour, SSEServer
from voicebot.config import load_settings


def histogram(metrics: str, name: str) -> dict:
    buckets = [(float(le), float(v)) for le, v in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', metrics, re.M)]
    total = float(re.search(rf"^{name}_sum (\S+)$", metrics, re.M).group(1))
    count = float(re.search(rf"^{name}_count (\S+)$", metrics, re.M).group(1))

    def quantile(q: float) -> float:
        return next(le for le, v in buckets if v >= q * count)

    return {"count": int(count), "mean_ms": 1000 * total / max(count, 1), "p50_le_ms": 1000 * quantile(0.5), "p90_le_ms": 1000 * quantile(0.9)}


async def turns(port: int, n: int) -> None:
    async with connect(f"ws://127.0.0.1:{port}/v1/voice") as ws:
        client = Client(ws)
        await client.start()
        for _ in range(n):
            await client.say_aloud("hello there")
            await client.until("audio.end", "error")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--first-ms", type=float, default=0)
    parser.add_argument("--token-ms", type=float, default=0)
    parser.add_argument("--tokens", type=int, default=12)
    args = parser.parse_args()

    sse = SSEServer().start()
    sse.reset(default=Behaviour(chunks=[f" word{i}" for i in range(args.tokens)] + ["."],
                                first_delay_s=args.first_ms / 1000, interval_s=args.token_ms / 1000))
    settings = load_settings(
        asr={"engine": "pocketsphinx", "pocketsphinx": {"phrases": PHRASES}},
        reply={"engine": "openai", "openai": {"base_url": sse.base_url, "model": "bench"}},
    )
    voice = VoiceServer(settings)
    try:
        asyncio.run(turns(voice.port, args.turns))
        metrics = httpx.get(f"http://127.0.0.1:{voice.port}/metrics").text
    finally:
        voice.stop()
        sse.stop()
    print(f"fake model: first token after {args.first_ms:g} ms, then {args.tokens + 1} deltas {args.token_ms:g} ms apart")
    for name in ("voicebot_reply_first_text_seconds", "voicebot_reply_total_seconds"):
        h = histogram(metrics, name)
        print(f"{name}: n={h['count']} mean={h['mean_ms']:.1f} ms median<={h['p50_le_ms']:.0f} ms p90<={h['p90_le_ms']:.0f} ms")


if __name__ == "__main__":
    main()
