"""bench/gpu_check.sh's dry run: every step of the GPU run at tiny size on CPU, so the script the
GPU box runs first has run end to end before it gets there (the CUDA-only parts say why they skip)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from voicebot.config.base import REPO_ROOT


def test_the_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run(["bash", "bench/gpu_check.sh", "--device", "cpu"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-2000:]
    assert (tmp_path / "gpu_check.txt").read_text() == out  # the figures kept under $OUT too
    # The correctness block: every bucket compared, the CUDA-only parts skipped with their reason.
    assert "correctness: all PASS" in out
    assert len(re.findall(r"bucket +\d+ \( *\d+ rows\).*PASS", out)) == 8
    assert "graph capture skipped: CUDA graphs need CUDA" in out and "set_sync_debug_mode needs CUDA" in out
    assert re.search(r"float16 against float32\n.*LM logits.*PASS\n.*flow mel.*PASS", out)
    assert re.search(r"streams' first chunks in one render.*\n.*batch - alone.*PASS", out)
    # Flow and HiFT at bucketed shapes: the capture skipped with its reason, the padded buckets compared.
    assert re.search(r"bucketed static shapes.*\n.*graph capture skipped: CUDA graphs need CUDA.*\n"
                     r".*at buckets - exact shapes.*PASS", out)
    # The serve passes all ended (bounded by work), so the comparison and capacity lines printed.
    for mode in ("batched", "unbatched"):
        for n in (1, 2):
            row = next(line for line in out.splitlines() if line.startswith(mode) and f"N={n:3d}" in line)
            assert int(row.split(" cut ")[1].split()[0]) == 0, row
    assert "throughput" in out and "admission: capacity" in out
    # The serve step with a flow window (on CUDA its renders are CUDA graphs): its pass ended, none cut.
    windowed = out.split("== serve, flow window 2 (render graphs)")[1].split("\n== ")[0]
    assert "flow window 2 chunks; renders eager" in windowed
    row = next(line for line in windowed.splitlines() if line.startswith("batched") and "N=  2" in line)
    assert int(row.split(" cut ")[1].split()[0]) == 0, row
    assert "gpu_check: every step ended cleanly" in out
