"""Flow and HiFT speed: one estimator call against the code before the packed estimator, and
chunks of several sessions rendered together against one at a time (issue 10).

Random weights at the released sizes (dense fp32 timing does not depend on the values), the
baseline's shapes (shared/specs/cosyvoice2-cpu-baseline.md): a 150-token (6 s) voice prompt whose
flow state covers 250 mel frames, chunks of 100 new frames. Every figure is printed as it is
measured; A/B pairs run alternately in one process and report medians, since the machine is shared.
Each figure is wall seconds with the process's CPU seconds beside it: on a shared machine a
process waits for a core (wall) without computing (CPU), so at 1 thread the CPU figures are the
ones to compare; with more threads CPU time also counts threads spinning at barriers.

1. One estimator call (one Euler step, CFG batch 2), ours against the estimator of BASELINE_REV
   (the code before this work, loaded from git, given the same weights): a cached streaming chunk
   (100 new frames after 250) and the non-streaming call of 5 s of speech (550 frames, full
   attention). With --profile, one call of each side under torch.profiler: its top ops, and its
   time by block. The official code's figures were measured on another CPU on another day; they
   are printed with that CPU's name, never as a ratio against this run.
2. One flow chunk (encoder + 10 Euler steps) for 1, 2, 4, 8 sessions in one `Flow.render`, against
   the same sessions one at a time (N × one session's chunk, measured alternately with it).
   Target on CPU at released size: 8 sessions in one call at most 4x one session's chunk.
3. HiFT: the decode of 1, 2, 4, 8 sessions' mel windows (the fast mode's window, lengths varied by
   a few frames so padding is paid) in one `decode_batch`, against one at a time; their f0 and
   source in one `excitations` batch against one at a time.

    python -m bench.flow                      # released sizes: a few minutes of 2 busy cores
    python -m bench.flow --size tiny          # the fixture sizes: seconds (tests run this)
    python -m bench.flow --only estimator --threads 1 --profile   # the estimator A/B and its profile
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)
from bench.cosyvoice2 import FIXTURES, OFFICIAL_CPU, cpu_model, released_hparams
from voicebot.config.base import REPO_ROOT
from voicebot.tts.cosyvoice2 import estimator as packed
from voicebot.tts.cosyvoice2.flow import FlowRequest, build_flow
from voicebot.tts.cosyvoice2.hift import HiFTStream, SourceNoise, SourceRequest, build_hift
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.loader import cpu_weight_layout

BASELINE_REV = "c6fc78b"  # main before this branch: residuals outside the GEMMs, cached attention block by block
N_PROMPT, HOP = 150, 50  # prompt tokens; the chunk's hop in tokens (100 mel frames)
NONSTREAM_FRAMES = 550  # 150 prompt + 125 target tokens, non-streaming
SESSIONS = (1, 2, 4, 8)
# shared/specs/cosyvoice2-cpu-baseline.md, "2026-12-01: official and ours side by side" (on OFFICIAL_CPU)
OFFICIAL = {"non-streaming flow, 5 s (s)": (16.28, 17.91), "HiFT, 1 s of mel (s)": (0.22, 0.228)}


def baseline_estimator_module():
    """estimator.py as of BASELINE_REV, imported from git under another name."""
    source = subprocess.run(["git", "show", f"{BASELINE_REV}:voicebot/tts/cosyvoice2/estimator.py"], cwd=REPO_ROOT,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_estimator.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_estimator", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    module.RequestRows = module.Segment  # its name there (renamed since: issue 26)
    return module


class Timing:
    """Median wall and CPU seconds of `reps` runs."""

    def __init__(self, wall: list[float], cpu: list[float]) -> None:
        self.wall, self.cpu = statistics.median(wall), statistics.median(cpu)

    def __str__(self) -> str:
        return f"{self.wall:8.3f} s ({self.cpu:7.3f} cpu)"

    def ratio(self, other: Timing) -> str:
        """self / other, wall and CPU."""
        return f"{self.wall / other.wall:.2f}x ({self.cpu / other.cpu:.2f}x cpu)"

    def times(self, n: int) -> Timing:
        timing = Timing([0.0], [0.0])
        timing.wall, timing.cpu = n * self.wall, n * self.cpu
        return timing


WARMUP = True  # one untimed run of each function first (--no-warmup: released-size batches are long)


def alternate(fns: dict[str, callable], reps: int) -> dict[str, Timing]:
    """Each function's timing, run in turn `reps` times after one warm-up each."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values() if WARMUP else ():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return {name: Timing(wall[name], cpu[name]) for name in fns}


def show(name: str, value: Timing, note: str = "") -> None:
    print(f"  {name:54s} {value} {note}", flush=True)


def profile_call(name: str, module, fn) -> None:
    """One call of `fn` under torch.profiler: its top ops by self time, and its time by block
    (`record_function` around each resnet, transformer block and causal conv of `module`)."""
    kinds = tuple(getattr(module, k) for k in ("CausalResnetBlock1D", "TransformerBlock", "CausalConv1d"))
    scopes, handles = [], []
    for m in fn.estimator.modules():
        if isinstance(m, kinds):
            def enter(mod, args, label=type(m).__name__):
                scopes.append(torch.profiler.record_function(label))
                scopes[-1].__enter__()

            def leave(mod, args, out):
                scopes.pop().__exit__(None, None, None)

            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        for h in handles:
            h.remove()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    blocks = sorted((e for e in events if e.key in {k.__name__ for k in kinds}), key=lambda e: -e.cpu_time_total)
    ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)[:10]
    print(f"  profile of one call, {name}: {total / 1e6:.3f} s; by block: " + ", ".join(
        f"{e.key} {e.cpu_time_total / total:.0%} ({e.count})" for e in blocks), flush=True)
    for e in ops:
        print(f"    {e.key:52s} {e.self_cpu_time_total / total:6.1%} {e.self_cpu_time_total / 1e6:8.3f} s "
              f"{e.count:5d} calls", flush=True)


def estimator_ab(est: packed.CausalConditionalDecoder, hp: dict, reps: int, profile: bool) -> None:
    print("\n1. one estimator call (one Euler step, CFG pair), ours vs the estimator of " + BASELINE_REV, flush=True)
    base = baseline_estimator_module()
    with torch.inference_mode(False):  # parameters made under inference mode cannot be written later
        old = base.build_estimator(hp["flow"]["decoder"]["estimator"]).eval()
        old.load_state_dict(est.state_dict())
        cpu_weight_layout(old)
    g = torch.Generator().manual_seed(1)
    prompt_frames = (N_PROMPT - 3) // 25 * 50  # the voice's prompt state (as Flow.prompt_cache)
    t = torch.tensor(0.5)

    def inputs(n: int) -> tuple[torch.Tensor, ...]:  # x, mu, spks, cond: the packed (2n, 80) rows
        spks = torch.randn(2, 80, generator=g).repeat_interleave(n, 0)
        x, mu, cond = (torch.randn(2 * n, 80, generator=g) for _ in range(3))
        return x, mu, spks, cond

    def call(module, estimator, n: int, streaming: bool, prompt_cache):
        """One call of `estimator` (built by `module`) on n new frames, after a fork of its
        prompt cache when given."""
        args = inputs(n)

        def run() -> torch.Tensor:
            cache = None if prompt_cache is None else prompt_cache.fork()
            return estimator(*args, t, [module.RequestRows(n, cache, streaming)])

        run.estimator = estimator
        return run

    def prompt_state(module, estimator):  # the voice's prompt frames, computed once; each timed call forks them
        cache = estimator.new_cache()
        estimator(*inputs(prompt_frames), t, [module.RequestRows(prompt_frames, cache)])
        return cache

    for label, n, streaming, cached in [
        (f"cached chunk: {2 * HOP} new frames after {prompt_frames}", 2 * HOP, True, True),
        (f"non-streaming: {NONSTREAM_FRAMES} frames, full attention", NONSTREAM_FRAMES, False, False),
    ]:
        g.manual_seed(n)  # the same inputs on both sides
        before = call(base, old, n, streaming, prompt_state(base, old) if cached else None)
        g.manual_seed(n)
        ours = call(packed, est, n, streaming, prompt_state(packed, est) if cached else None)
        err = (before() - ours()).abs().max().item()
        med = alternate({"before": before, "ours": ours}, reps)
        print(f"  {label} (max abs difference {err:.1e})", flush=True)
        show("before", med["before"])
        show("ours", med["ours"], f"before / ours {med['before'].ratio(med['ours'])}")
        if profile:
            profile_call("before", base, before)
            profile_call("ours", packed, ours)
    official, before_figure = OFFICIAL["non-streaming flow, 5 s (s)"]
    print(f"  official non-streaming flow, 5 s: {official} s vs ours {before_figure} s (then) on {OFFICIAL_CPU}: "
          f"official / before {official / before_figure:.2f}x there (this run's CPU: {cpu_model()})", flush=True)


def flow_batch(flow, reps: int) -> None:
    print("\n2. one flow chunk (encoder + 10 Euler steps), N sessions in one render vs one at a time", flush=True)
    g = torch.Generator().manual_seed(2)
    vocab = flow.input_embedding.num_embeddings
    prompt_token = torch.randint(0, vocab, (1, N_PROMPT), generator=g, dtype=torch.int32)
    prompt_feat, embedding = torch.randn(1, 2 * N_PROMPT, 80, generator=g), torch.randn(1, 192, generator=g)
    state = flow.prompt_cache(prompt_token, prompt_feat, embedding)  # the voice's, shared by the sessions
    # each session's first chunk: its hop (plus the pad to the prompt's chunk boundary) and lookahead
    n_tokens = -N_PROMPT % 25 + HOP + flow.pre_lookahead_len
    tokens = [torch.randint(0, vocab, (1, n_tokens), generator=g, dtype=torch.int32) for _ in range(max(SESSIONS))]

    def requests(n: int) -> list[FlowRequest]:
        return [FlowRequest(tokens[i], prompt_token, prompt_feat, embedding, True, False, state.fork()) for i in range(n)]

    computed = (N_PROMPT + n_tokens - flow.pre_lookahead_len) * flow.token_mel_ratio - state.n_frames
    print(f"  each session renders its reply's first chunk: {n_tokens} tokens, {computed} frames computed after "
          f"the voice's {state.n_frames} (its own fork of the voice's state)", flush=True)
    show("1 session: one render", alternate({"one": lambda: flow.render(requests(1))}, reps)["one"])
    for n in SESSIONS[1:]:
        med = alternate({"one": lambda: flow.render(requests(1)), "batched": lambda n=n: flow.render(requests(n))}, reps)
        one_at_a_time = med["one"].times(n)
        show(f"{n} sessions in one render", med["batched"],
             f"= {med['batched'].ratio(med['one'])} one session's chunk; one at a time {one_at_a_time.wall:.3f} s: "
             f"{one_at_a_time.ratio(med['batched'])}" + ("  [target: at most 4x]" if n == 8 else ""))


def hift_batch(hift, reps: int) -> None:
    print("\n3. HiFT decode, N sessions' mel windows in one decode_batch vs one at a time", flush=True)
    context, f0_context = hift.context_frames()
    window = 2 * HOP + context + (context + f0_context)  # a fast-mode push of one chunk: context | new | held
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        mels = [torch.randn(1, 80, window + i % 3 * 4, generator=g) for i in range(max(SESSIONS))]
        sources = [hift.excitation(m, noise=SourceNoise.zeros(m.shape[2] * hift.samples_per_frame,
                                                              hift.m_source.n_harmonics)) for m in mels]
        def one_push():  # a fast-mode push up to its decode: the window, then its f0 and source
            return hift.excitations([HiFTStream(hift, zero_noise=True).prepare(mels[0]).source_request])

        excitation = alternate({"e": one_push}, reps)["e"]
        show("f0 + source of one window", excitation)
        requests = [SourceRequest(m, None) for m in mels]
        med = alternate({"one at a time": lambda: [hift.excitations([r]) for r in requests],
                         "batched": lambda: hift.excitations(requests)}, reps)
        show(f"f0 + source of {len(mels)} windows in one batch", med["batched"],
             f"one at a time {med['one at a time']}: {med['one at a time'].ratio(med['batched'])}")
        for n in SESSIONS:
            med = alternate({"one at a time": lambda n=n: [hift.decode(m, s) for m, s in zip(mels[:n], sources[:n])],
                             "batched": lambda n=n: hift.decode_batch(mels[:n], sources[:n])}, reps)
            show(f"{n} window(s) of ~{window} frames in one decode", med["batched"],
                 f"one at a time {med['one at a time']}: {med['one at a time'].ratio(med['batched'])}")
    official, before = OFFICIAL["HiFT, 1 s of mel (s)"]
    print(f"  official HiFT, 1 s of mel: {official} s vs before {before} s on {OFFICIAL_CPU} (this run's CPU: "
          f"{cpu_model()})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["released", "tiny"], default="released")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the baseline used 2)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs of each A/B side (median)")
    parser.add_argument("--fixtures", type=Path, default=FIXTURES)
    parser.add_argument("--only", default="estimator,flow,hift", help="sections to run")
    parser.add_argument("--no-warmup", action="store_true", help="time the first run too (saves minutes)")
    parser.add_argument("--profile", action="store_true", help="profile one estimator call of each side")
    args = parser.parse_args()
    global WARMUP
    WARMUP = not args.no_warmup
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        hp = released_hparams(args.fixtures, Path(tmp)) if args.size == "released" else load_hparams(args.fixtures)
    flow, hift = cpu_weight_layout(build_flow(hp["flow"]).eval()), cpu_weight_layout(build_hift(hp["hift"]).eval())
    print(f"{args.size} flow and HiFT, random weights, fp32, {args.threads} threads, {cpu_model()}, "
          f"torch {torch.__version__}, python {sys.version.split()[0]}", flush=True)
    sections = args.only.split(",")
    with torch.inference_mode():
        if "estimator" in sections:
            estimator_ab(flow.decoder.estimator, hp, args.reps, args.profile)
        if "flow" in sections:
            flow_batch(flow, args.reps)
    if "hift" in sections:
        hift_batch(hift, args.reps)


if __name__ == "__main__":
    main()
