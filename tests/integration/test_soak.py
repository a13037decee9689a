"""bench/soak.py's short mode (~30 s): every kind of client at once, nothing lost, nobody dead."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from voicebot.config.base import REPO_ROOT


def test_short_soak():
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "soak.py"), "--short"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.stdout.strip(), done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-3000:]
    assert summary["lost_frames"] == 0 and summary["deaths"] == 0 and summary["server_tracebacks"] == 0
    # Every kind of client got through at least once: replies, barge-ins, resumes, hostile input.
    assert summary["replies"] > 0 and summary["interrupted"] > 0 and summary["fuzz_messages"] > 0
    assert summary["reconnects"] > 0 and summary["resumed"] == summary["reconnects"]
    assert summary["frames_received"] == summary["frames_promised"] > 0
