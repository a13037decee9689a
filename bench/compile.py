"""torch.compile against eager, side by side in one run: the LM decode step and one flow estimator call.

Random weights (dense fp32 timing does not depend on them), alternating runs, medians of wall and
CPU seconds (bench/flow.py's `alternate`), the compile time of each variant printed beside it:

1. LM decode step at 1 and 16 rows, context 200 (the pool's forward: every row at its own position,
   masked per row, attending over the written prefix in KV_BUCKET steps): eager, as the pool runs it
   (linear layers on prepacked weights for more than one row), against `torch.compile` (inductor)
   and `torch.compile` with inductor's freezing (which prepacks the weights itself).
2. One flow estimator call (one Euler step, CFG pair), non-streaming, 200 frames: eager against
   `torch.compile`.

    python -m bench.compile --size tiny        # seconds of timing, about a minute of compiling
    python -m bench.compile --size released    # minutes: inductor compiles 24 Qwen2 layers
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch._inductor.config

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)
from bench.cosyvoice2 import FIXTURES, released_hparams
from bench.flow import Timing, alternate
from voicebot.tts.cosyvoice2.estimator import RequestRows, build_estimator
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, build_lm, keys_to_attend
from voicebot.tts.cosyvoice2.loader import cpu_weight_layout

CONTEXT = 200
FLOW_FRAMES = 200


def ms(timing: Timing) -> str:
    return f"{1000 * timing.wall:8.2f} ms ({1000 * timing.cpu:7.2f} cpu)"


def timed_first_call(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def lm_decode(lm: CosyVoice2LM, reps: int) -> None:
    print(f"\n1. LM decode step, context {CONTEXT}: eager (the pool's) vs torch.compile", flush=True)
    w = lm.llm_decoder.weight
    lm.prepack()
    n_keys = keys_to_attend(CONTEXT + 1, lm.cfg.max_position_embeddings)  # as the pool passes it: no host sync

    def step(x, pos, cache):
        return lm.logp(lm.qwen(x, pos, cache, None, n_keys)[:, -1])

    compiled = torch.compile(step, dynamic=False)
    for rows in (1, 16):
        cache = lm.new_cache(n_keys, batch=rows)
        x = torch.randn(rows, 1, w.shape[1], dtype=w.dtype)
        pos = torch.full((rows, 1), CONTEXT)
        fns = {"eager": lambda: step(x, pos, cache), "compiled": lambda: compiled(x, pos, cache)}
        with torch.inference_mode():
            compile_s = timed_first_call(fns["compiled"])
            err = (fns["eager"]() - fns["compiled"]()).abs().max().item()
            med = alternate(fns, reps)
        print(f"  {rows:2d} rows  eager {ms(med['eager'])}  compiled {ms(med['compiled'])}  eager / compiled "
              f"{med['eager'].ratio(med['compiled'])}  (compile {compile_s:.1f} s, max abs logp difference {err:.1e})",
              flush=True)
    torch._dynamo.reset()
    torch._inductor.config.freezing = True  # weights become constants, prepacked by inductor
    try:
        frozen = torch.compile(step, dynamic=False)
        for rows in (1, 16):
            cache = lm.new_cache(n_keys, batch=rows)
            x = torch.randn(rows, 1, w.shape[1], dtype=w.dtype)
            pos = torch.full((rows, 1), CONTEXT)
            fns = {"eager": lambda: step(x, pos, cache), "frozen": lambda: frozen(x, pos, cache)}
            with torch.inference_mode():
                compile_s = timed_first_call(fns["frozen"])
                med = alternate(fns, reps)
            print(f"  {rows:2d} rows  eager {ms(med['eager'])}  compiled+freezing {ms(med['frozen'])}  eager / compiled "
                  f"{med['eager'].ratio(med['frozen'])}  (compile {compile_s:.1f} s)", flush=True)
    finally:
        torch._inductor.config.freezing = False
        torch._dynamo.reset()


def flow_estimator(hp: dict, reps: int) -> None:
    print(f"\n2. flow estimator, one call (CFG pair), non-streaming, {FLOW_FRAMES} frames: eager vs torch.compile",
          flush=True)
    est = cpu_weight_layout(build_estimator(hp["flow"]["decoder"]["estimator"]).eval())
    g = torch.Generator().manual_seed(1)
    x, mu, cond = (torch.randn(2 * FLOW_FRAMES, 80, generator=g) for _ in range(3))
    spks, t = torch.randn(2 * FLOW_FRAMES, 80, generator=g), torch.tensor(0.5)
    compiled = torch.compile(est, dynamic=False)

    def call(module):
        return module(x, mu, spks, cond, t, [RequestRows(FLOW_FRAMES, None, streaming=False)])

    fns = {"eager": lambda: call(est), "compiled": lambda: call(compiled)}
    with torch.inference_mode():
        fns["eager"]()  # the first call fuses q/k/v into one weight (parameters become views): before tracing
        compile_s = timed_first_call(fns["compiled"])
        err = (fns["eager"]() - fns["compiled"]()).abs().max().item()
        med = alternate(fns, reps)
    print(f"  eager {ms(med['eager'])}  compiled {ms(med['compiled'])}  eager / compiled {med['eager'].ratio(med['compiled'])}"
          f"  (compile {compile_s:.1f} s, max abs difference {err:.1e})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", "released"], default="tiny")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--only", choices=["lm", "flow"], help="one of the two measurements")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.size} sizes, fp32, {args.threads} threads, torch {torch.__version__} "
          f"(load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        hp = released_hparams(FIXTURES, Path(tmp)) if args.size == "released" else load_hparams(FIXTURES)
        torch.manual_seed(0)
        if args.only in (None, "lm"):
            lm_decode(cpu_weight_layout(build_lm(hp).eval()), args.reps)
        if args.only in (None, "flow"):
            flow_estimator(hp, args.reps)


if __name__ == "__main__":
    main()
