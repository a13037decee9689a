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

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)
from tests.conftest import TEST_PHRASES, VoiceClient, make_settings, running_server, speech_pcm
from tests.reply.sse_server import Behaviour, SSEServer


def histogram(metrics: str, name: str, before: dict | None = None) -> dict:
    """A histogram from /metrics text, less what `before` (an earlier reading) had counted."""
    buckets = [(float(le), float(v)) for le, v in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', metrics, re.M)]
    total = float(re.search(rf"^{name}_sum (\S+)$", metrics, re.M).group(1))
    count = float(re.search(rf"^{name}_count (\S+)$", metrics, re.M).group(1))
    if before:
        buckets = [(le, v - b) for (le, v), (_, b) in zip(buckets, before["buckets"])]
        total, count = total - before["sum"], count - before["count"]
    p50, p90 = (next(le for le, v in buckets if v >= q * count) for q in (0.5, 0.9))
    return {"buckets": buckets, "sum": total, "count": count, "mean_ms": 1000 * total / max(count, 1),
            "p50_le_ms": 1000 * p50, "p90_le_ms": 1000 * p90}


async def turns(url: str, n: int) -> None:
    speech = speech_pcm(TEST_PHRASES[0])
    async with VoiceClient.connect(url) as client:
        for i in range(n):
            await client.stream(speech, speed=4)
            await client.wait_for("audio.end", count=i + 1)


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
    settings = make_settings(reply={"engine": "openai", "openai": {"base_url": sse.base_url, "model": "bench"}})
    try:
        with running_server(settings) as voice:
            before = voice.get("/metrics").text  # after the server's warm-up utterance
            asyncio.run(turns(voice.ws_url, args.turns))
            metrics = voice.get("/metrics").text
    finally:
        sse.stop()
    print(f"fake model: first token after {args.first_ms:g} ms, then {args.tokens + 1} deltas {args.token_ms:g} ms apart")
    for name in ("voicebot_reply_first_text_seconds", "voicebot_reply_total_seconds"):
        h = histogram(metrics, name, histogram(before, name))
        print(f"{name}: n={h['count']:.0f} mean={h['mean_ms']:.1f} ms median<={h['p50_le_ms']:.0f} ms p90<={h['p90_le_ms']:.0f} ms")


if __name__ == "__main__":
    main()
