"""End-of-speech to first reply audio, with 1, 4 and 8 clients streaming speech in real time.

    python bench/latency.py [--config configs/default.yaml] [--clients 1 4 8] [--turns 3]

Starts the server (a subprocess on 127.0.0.1) with the given config plus a phrase grammar for the
test sentences, then runs each client count in turn. Per turn it records the server's own
timings: `first_audio_ms` (VAD end of speech -> first reply frame sent) and `endpoint_delay_ms`
(end of speech -> endpoint decision, mostly the configured silence), plus frames sent late
(underruns). With configs/default.yaml these figures are the pipeline's overhead: pocketsphinx,
echo and espeak are not the production engines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import TEST_PHRASES, VoiceClient, free_port, speech_pcm  # noqa: E402


async def client_run(url: str, turns: int, offset: int) -> list[dict]:
    results = []
    async with VoiceClient.connect(url) as client:
        for turn in range(turns):
            text = TEST_PHRASES[(offset + turn) % len(TEST_PHRASES)]
            await client.stream(speech_pcm(text, lead_s=0.5, tail_s=1.0))
            end = await client.wait_for("audio.end", count=turn + 1, timeout=60)
            final = client.of_type("asr.final")[turn]
            results.append({**end["timings"], "frames": end["frames"], "endpoint_delay_ms": final["timings"]["endpoint_delay_ms"],
                            "correct": final["text"] == text})
            await asyncio.sleep(0.5 + 0.3 * (offset % 3))  # clients drift apart, as real ones do
    return results


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()

    config = yaml.safe_load(Path(args.config).read_text())
    port = free_port()
    config.setdefault("server", {}).update({"port": port, "max_sessions": max(args.clients) + 1})
    if config.get("asr", {}).get("engine", "pocketsphinx") == "pocketsphinx":
        config.setdefault("asr", {}).setdefault("pocketsphinx", {})["phrases"] = TEST_PHRASES
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    server = subprocess.Popen([sys.executable, str(ROOT / "run_server.py"), "--config", f.name], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        url = f"ws://127.0.0.1:{port}/v1/voice"
        asyncio.run(client_run(url, 1, 0))  # warm-up
        print(f"config {args.config}; {args.turns} turns per client; figures from the server's own events")
        print(f"{'clients':>7} {'turns':>5} {'first audio p50':>16} {'p95':>8} {'endpoint p50':>13} {'p95':>8} {'frames on time':>15} {'exact text':>10}")
        for n in args.clients:
            async def together():
                return await asyncio.gather(*(client_run(url, args.turns, i) for i in range(n)))

            rows = [r for per_client in asyncio.run(together()) for r in per_client]
            first = [r["first_audio_ms"] for r in rows]
            endpoint = [r["endpoint_delay_ms"] for r in rows]
            frames = sum(r["frames"] for r in rows)
            late = sum(r["underruns"] for r in rows)
            print(f"{n:>7} {len(rows):>5} {pct(first, 50):>13.0f} ms {pct(first, 95):>5.0f} ms {pct(endpoint, 50):>10.0f} ms "
                  f"{pct(endpoint, 95):>5.0f} ms {100 * (frames - late) / frames:>14.1f}% {sum(r['correct'] for r in rows):>5}/{len(rows)}")
    finally:
        server.terminate()
        server.wait(30)
        os.unlink(f.name)


if __name__ == "__main__":
    main()
