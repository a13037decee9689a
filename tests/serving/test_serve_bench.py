"""bench/serve.py at tiny size for a few seconds: the CI smoke run of the many-sessions benchmark,
in process and end to end through the server over WebSockets."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.cosyvoice2 import FIXTURES
from voicebot.config.base import REPO_ROOT


def test_serve_bench_runs_batched_unbatched_and_through_the_server_at_tiny_size():
    assert (FIXTURES / "golden.safetensors").is_file(), f"the fixture set ships in the repository: {FIXTURES}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "bench.serve", "--size", "tiny", "--seconds", "1", "--sessions", "2",
                          "--threads", "1", "--server", "2"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for mode in ("batched", "unbatched"):
        for n in (2,):
            row = next(line for line in lines if line.startswith(mode) and f"N={n:3d}" in line)
            assert "first p50" in row and "speech s/s" in row and "batches" in row
    assert any("throughput" in line for line in lines) and any("admission: capacity" in line for line in lines)
    server = next((line for line in lines if line.startswith("server") and "N=  2" in line), None)
    assert server is not None, out.stdout[-3000:] + out.stderr[-3000:]
    replies = int(server.split("replies")[1].split()[0])
    busy = int(server.split("busy")[1].split()[0])
    # Every client was either turned away or heard replies, whose first audio was measured.
    assert replies >= 2 - busy and busy < 2 and "first p50" in server and "server underruns" in server, server
