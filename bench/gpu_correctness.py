"""The correctness block that opens bench/gpu_check.sh: what must hold on the GPU before its speed
figures mean anything. Random weights (seeded) at released size on CUDA, tiny size for the CPU dry run.

1. float16 against float32: LM logits within HALF_LOGITS of the peak, flow mel within HALF_MEL.
2. The CUDA-graph decode step equals the eager one, per bucket, in the serving dtype (--dtype):
   log-probs within GRAPH_VS_EAGER of the peak and the same argmax, rows at different positions in
   scattered slots.
3. Host syncs per decode step at 1 / 16 / 64 rows (torch.cuda.set_sync_debug_mode; target 1).
4. A render of several streams' first chunks in one call against each stream alone (flow + HiFT,
   the serving dtype): within BATCH_VS_ALONE of the peak.
5. That render launched on a side stream (Token2Wav.launch, as the synthesizer serves on CUDA) while
   LM decode steps run on the default stream: the same audio as on the default stream alone (within
   SIDE_VS_DEFAULT of the peak), no host sync in the launch, and how many LM steps ran meanwhile.

6. Flow and HiFT at bucketed static shapes (Token2Wav(bucketed=True), a 2-chunk flow window): on
   CUDA every bucket captured as a CUDA graph, each replay against the same function run eagerly on
   the same inputs (within GRAPH_VS_EAGER of the peak); then, on any device, streams rendered at
   their buckets against the eager flow at their exact shapes (within BATCH_VS_ALONE).

Each line is printed as it is measured, with its bound and PASS or FAIL; the exit status is 1 if
any check failed. On CPU the CUDA-only parts say why they are skipped and what runs instead.

    python3 bench/gpu_correctness.py --device cuda                 # released size, float16
    python3 bench/gpu_correctness.py --device cpu --size tiny --dtype float32   # the dry run
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)
from bench.cosyvoice2 import FIXTURES, released_hparams
from voicebot.config.base import REPO_ROOT
from voicebot.tts.cosyvoice2.lm_pool import DECODE_BUCKETS, LMPool
from voicebot.tts.cosyvoice2.flow import build_flow
from voicebot.tts.cosyvoice2.hift import build_hift
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, Step, build_lm
from voicebot.tts.cosyvoice2.loader import cpu_weight_layout
from voicebot.tts.cosyvoice2.sampling import RasSampler
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav

sys.path.insert(0, str(REPO_ROOT / "tests" / "cosyvoice2"))
from golden_bounds import HALF_LOGITS, max_error_to_peak  # noqa: E402  (the golden tests' bounds)

# The graph replays the eager step's kernels on padded shapes (attention over the whole cache,
# masked): the same sums in another order, a few roundings of the dtype at the peak.
GRAPH_VS_EAGER = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# The flow's mel in float16 against float32: 10 solver steps of a 22-block estimator, each
# rounding at 2^-11; the same order as HALF_LOGITS, which the LM's 24 layers reach.
HALF_MEL = 0.02
# Several streams in one render against each alone, same dtype: the padding and batching change
# the order of sums, and HiFT amplifies the mel's rounding (golden_bounds: 3e-7 -> 1.8e-4 in fp32).
BATCH_VS_ALONE = {torch.float32: 3e-3, torch.float16: 0.02, torch.bfloat16: 0.05}

# The same kernels on the same inputs, only on another stream: equal but for a kernel choice.
SIDE_VS_DEFAULT = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

failures: list[str] = []


def report(what: str, value: float, bound: float, extra: str = "") -> None:
    ok = value <= bound
    if not ok:
        failures.append(what)
    print(f"  {what:58s} {value:10.3g}  (bound {bound:g})  {'PASS' if ok else 'FAIL'}{extra}", flush=True)


def build(size: str, tmp: Path) -> tuple[dict, CosyVoice2LM, torch.nn.Module, torch.nn.Module]:
    hp = released_hparams(FIXTURES, tmp) if size == "released" else load_hparams(FIXTURES)
    torch.manual_seed(0)
    return hp, build_lm(hp).eval(), build_flow(hp["flow"]).eval(), build_hift(hp["hift"]).eval()


class Recorder:
    """A sampler that keeps each row's log-probs and takes the argmax (a per-row sampler: it syncs)."""

    def __init__(self) -> None:
        self.logp: list[torch.Tensor] = []

    def __call__(self, logp: torch.Tensor, history) -> int:
        self.logp.append(logp.float().cpu())
        return int(logp.argmax())


def _program(prefix: torch.Tensor, steps: torch.Tensor):
    """Prefill `prefix` (1, L, D), then one position of `steps` (n, D) at a time."""
    yield Step(prefix, 0, ())
    for i in range(steps.shape[0]):
        yield Step(steps[i].reshape(1, 1, -1), prefix.shape[1] + i, ())


def decode_logps(lm: CosyVoice2LM, graphs: bool, rows: int, seq: int, n_steps: int) -> list[torch.Tensor]:
    """`rows` rows (prefixes of 3..3+rows positions, in slots scattered by rows that ended) in a
    pool of the largest bucket's slots, stepped n_steps times together: each row's log-probs per step."""
    w = lm.llm_decoder.weight
    slots = DECODE_BUCKETS[-1]
    pool = LMPool(lm, slots, seq, graphs=graphs, prepack=False)
    gen = torch.Generator().manual_seed(rows)
    spacers = [pool.open(Recorder()) for _ in range(min(rows, slots - rows))]  # rows land in scattered slots
    opened = []
    for i in range(rows):
        recorder = Recorder()
        row = pool.open(recorder)
        prefix = torch.randn(1, 3 + i, w.shape[1], generator=gen).to(w.device, w.dtype)
        steps = torch.randn(n_steps, w.shape[1], generator=gen).to(w.device, w.dtype)
        pool.start(row, _program(prefix, steps))
        opened.append((row, recorder))
    for spacer in spacers:
        pool.close(spacer)
    for row, _ in opened:
        while row.waiting > 1:
            pool.prefill(row)
    for _ in range(n_steps):
        pool.decode([row for row, _ in opened if row.waiting == 1])
    return [torch.stack(recorder.logp[1:]) for _, recorder in opened]  # [0]: the prefill's


def check_graphs(lm: CosyVoice2LM, device: torch.device, slots: int) -> None:
    print(f"\n2. CUDA-graph decode against eager, per bucket (rows at positions 3.., scattered slots, 4 steps)", flush=True)
    if device.type != "cuda":
        print("  graph capture skipped: CUDA graphs need CUDA; the padded bucket path (the graph's shapes, "
              "run eagerly) is compared instead", flush=True)
    bound = GRAPH_VS_EAGER[lm.llm_decoder.weight.dtype]
    for bucket in [b for b in DECODE_BUCKETS if b <= slots]:
        rows = max(1, bucket - 1) if bucket > 2 else bucket  # a padded bucket where it can be
        began = time.perf_counter()
        graphed = decode_logps(lm, True, rows, 256, 4)
        took = time.perf_counter() - began
        eager = decode_logps(lm, False, rows, 256, 4)
        error = max(max_error_to_peak(g, e) for g, e in zip(graphed, eager))
        same = all(torch.equal(g.argmax(-1), e.argmax(-1)) for g, e in zip(graphed, eager))
        if not same:
            failures.append(f"graph argmax at bucket {bucket}")
        report(f"bucket {bucket:2d} ({rows:2d} rows): max |graph - eager| / peak", error, bound,
               f"  argmax {'equal' if same else 'DIFFERS'}; capture+run {took:.2f} s")


def check_syncs(lm: CosyVoice2LM, device: torch.device) -> None:
    print("\n3. host syncs per LM decode step (RAS rows; target 1 at every batch size)", flush=True)
    if device.type != "cuda":
        print("  skipped: torch.cuda.set_sync_debug_mode needs CUDA (tests/cosyvoice2/test_lm_syncs.py counts "
              "them on CPU)", flush=True)
        return
    w = lm.llm_decoder.weight
    for rows in (1, 16, 64):
        pool = LMPool(lm, rows, 512, graphs=True, prepack=False)
        opened = []
        for i in range(rows):
            row = pool.open(RasSampler(generator=torch.Generator(device).manual_seed(i)))
            x = torch.randn(1, 8, w.shape[1], device=device, dtype=w.dtype)
            pool.start(row, _program(x, torch.randn(40, w.shape[1], device=device, dtype=w.dtype)))
            while row.waiting > 1:
                pool.prefill(row)
            opened.append(row)
        pool.decode(opened)  # the graph's capture, outside the count
        counts = []
        for _ in range(8):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    pool.decode(opened)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
        report(f"{rows:2d} rows: host syncs per step (max of 8 steps)", max(counts), 1, f"  all: {counts}")


def check_half(hp: dict, lm: CosyVoice2LM, flow: torch.nn.Module, device: torch.device) -> None:
    """float16 against float32 (the GPU's serving dtype against the reference), whatever --dtype."""
    dtype = torch.float16
    print("\n1. float16 against float32", flush=True)
    gen = torch.Generator().manual_seed(0)
    d = lm.cfg.hidden_size
    x = torch.randn(1, 64, d, generator=gen)
    logits = {}
    for dt in (torch.float32, dtype):
        m = copy.deepcopy(lm).to(device, dt)  # the weights stay float32 for what follows
        with torch.inference_mode():
            h = m.qwen(x.to(device, dt), torch.arange(64, device=device), m.new_cache(64))
            logits[dt] = m.llm_decoder(h).float().cpu()
    report("LM logits (64 positions): max error / peak", max_error_to_peak(logits[dtype], logits[torch.float32]),
           HALF_LOGITS)
    n_prompt, n_tokens = 50, 40
    token = torch.randint(0, hp["flow"]["vocab_size"], (1, n_tokens), generator=gen)
    prompt_token = torch.randint(0, hp["flow"]["vocab_size"], (1, n_prompt), generator=gen)
    feat = torch.randn(1, 2 * n_prompt, hp["flow"]["output_size"], generator=gen)
    embedding = torch.randn(1, hp["spk_embed_dim"], generator=gen)
    mels = {}
    for dt in (torch.float32, dtype):
        f = copy.deepcopy(flow).to(device, dt)
        mels[dt] = f.inference(token.to(device), prompt_token.to(device), feat.to(device, dt), embedding.to(device, dt),
                               streaming=False, finalize=True).float().cpu()
    report(f"flow mel ({n_tokens} tokens, prompt {n_prompt}): max error / peak",
           max_error_to_peak(mels[dtype], mels[torch.float32]), HALF_MEL)


def check_batch_render(hp: dict, flow: torch.nn.Module, hift: torch.nn.Module, device: torch.device,
                       dtype: torch.dtype, streams: int = 4, lm: CosyVoice2LM | None = None) -> None:
    print(f"\n4. {streams} streams' first chunks in one render against each alone "
          f"({str(dtype).removeprefix('torch.')}, exact mode, HiFT noise off)", flush=True)
    gen = torch.Generator().manual_seed(1)
    vocab = hp["flow"]["vocab_size"]
    t2w = Token2Wav(flow.to(device, dtype), hift.to(device), mode="exact")
    prompts = []
    for i in range(streams):  # prompts of different lengths: streams at different offsets
        n = 30 + 7 * i
        prompts.append(FlowPrompt(torch.randint(0, vocab, (1, n), generator=gen).to(device),
                                  torch.randn(1, 2 * n, hp["flow"]["output_size"], generator=gen).to(device, dtype),
                                  torch.randn(1, hp["spk_embed_dim"], generator=gen).to(device, dtype)))
    tokens = [torch.randint(0, vocab, (200,), generator=gen).tolist() for _ in range(streams)]

    def first_chunks():
        chunks = []
        for prompt, toks in zip(prompts, tokens):
            stream = t2w.stream(prompt, zero_noise=True)
            stream.add(toks[: stream.tokens_for_next_chunk])
            chunks.append(stream.next_chunk())
        return chunks

    alone = [t2w.render([chunk])[0].float().cpu() for chunk in first_chunks()]
    began = time.perf_counter()
    together = [a.float().cpu() for a in t2w.render(first_chunks())]
    took = time.perf_counter() - began
    error = max(max_error_to_peak(t, a) for t, a in zip(together, alone))
    report(f"audio: max |batch - alone| / peak", error, BATCH_VS_ALONE[dtype], f"  (batched render {took:.2f} s)")
    check_side_stream(lm, t2w, first_chunks, together, device, dtype)


def check_side_stream(lm: CosyVoice2LM, t2w: Token2Wav, first_chunks, on_default: list[torch.Tensor],
                      device: torch.device, dtype: torch.dtype) -> None:
    print("\n5. the same render on a side stream while LM steps run on the default one", flush=True)
    if device.type != "cuda":
        print("  skipped: CUDA streams need CUDA (tests/serving/test_scheduler.py runs the scheduler's overlap "
              "with a stand-in render)", flush=True)
        return
    w = lm.llm_decoder.weight
    pool = LMPool(lm, 16, 512, graphs=True, prepack=False)
    rows = []
    for i in range(16):
        row = pool.open(RasSampler(generator=torch.Generator(device).manual_seed(i)))
        pool.start(row, _program(torch.randn(1, 8, w.shape[1], device=device, dtype=w.dtype),
                                 torch.randn(400, w.shape[1], device=device, dtype=w.dtype)))
        while row.waiting > 1:
            pool.prefill(row)
        rows.append(row)
    pool.decode(rows)  # the bucket's capture, before the render
    chunks = first_chunks()
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rendering = t2w.launch(chunks, torch.cuda.Stream(device))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    steps = 0
    while not rendering.ready() and all(row.waiting == 1 for row in rows):
        pool.decode(rows)
        steps += 1
    audio = [torch.from_numpy(a) for a in rendering.audio()]
    error = max(max_error_to_peak(a, d.reshape(-1)) for a, d in zip(audio, on_default))
    report("audio: max |side stream - default stream| / peak", error, SIDE_VS_DEFAULT[dtype],
           f"  ({steps} LM steps of 16 rows ran during the render)")
    report("host syncs in the render's launch", syncs, 0)


def check_render_graphs(hp: dict, flow: torch.nn.Module, hift: torch.nn.Module, device: torch.device,
                        dtype: torch.dtype, max_streams: int = 4) -> None:
    print(f"\n6. flow and HiFT at bucketed static shapes (window 2 chunks, up to {max_streams} streams a render)",
          flush=True)
    gen = torch.Generator().manual_seed(2)
    flow, hift = flow.to(device, dtype), hift.to(device)
    bucketed = Token2Wav(flow, hift, mode="fast", flow_left_chunks=2, max_render_streams=max_streams, bucketed=True)
    bound = GRAPH_VS_EAGER[dtype]
    if device.type != "cuda":
        print("  graph capture skipped: CUDA graphs need CUDA; the padded buckets run eagerly and are compared with "
              "the eager flow at exact shapes below", flush=True)
    else:
        began = time.perf_counter()
        n_graphs = bucketed.capture_graphs()
        print(f"  {n_graphs} graphs captured in {time.perf_counter() - began:.1f} s "
              f"(flow {bucketed.window_flow.buckets[0]}..{bucketed.window_flow.buckets[-1]}, HiFT "
              f"{bucketed.hift_buckets.buckets[0]}..{bucketed.hift_buckets.buckets[-1]}, streams × frames); "
              f"{torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated", flush=True)
        window = bucketed.window_flow
        pool = window.slots.keys, window.slots.values, window.slots.conv  # the states the graphs read in place
        for streams, frames in window.buckets:  # random inputs in the bucket: the last stream short of it
            n_new = [frames - (7 if s == streams - 1 else 0) for s in range(streams)]
            start = [50 * (2 + s) for s in range(streams)]
            slots = list(range(streams - 1, -1, -1))  # the streams' slots, in another order than theirs
            for t in pool:
                t.normal_(generator=torch.Generator(device).manual_seed(streams))
            states = [t.clone() for t in pool]
            inputs = (torch.randn(streams, frames, 80, generator=gen).to(device, dtype),
                      torch.randn(streams, 80, generator=gen).to(device, dtype),
                      torch.randn(streams, frames, 80, generator=gen).to(device, dtype),
                      torch.tensor([start, [100] * streams, n_new, slots], device=device))
            graphed = window.graphs.run((streams, frames), tuple(t.clone() for t in inputs))[0].clone()
            graphed_states = [t.clone() for t in pool]
            for t, before in zip(pool, states):
                t.copy_(before)
            with torch.inference_mode():
                eager = window._solve(*(t.clone() for t in inputs))[0]
            error = max(max_error_to_peak(graphed[s, :n].float().cpu(), eager[s, :n].float().cpu())
                        for s, n in enumerate(n_new))
            state_error = max(max_error_to_peak(g.float().cpu(), e.float().cpu()) for g, e in zip(graphed_states, pool))
            report(f"flow bucket {streams} × {frames:3d}: max |graph - eager| / peak (mel; states)", max(error, state_error),
                   bound, f"  mel {error:.2g}, states {state_error:.2g}")
        for rows, frames in bucketed.hift_buckets.buckets:
            lengths = [frames - (5 if b == rows - 1 else 0) for b in range(rows)]
            mels = [torch.randn(1, 80, n, generator=gen).to(device) for n in lengths]
            sources = [torch.randn(1, 1, n * hift.samples_per_frame, generator=gen).to(device) * 0.1 for n in lengths]
            padded = hift.padded_batch(mels, sources, (rows, frames))
            graphed = bucketed.hift_buckets.graphs.run((rows, frames), padded)[0].clone()
            with torch.inference_mode():
                eager = hift.decode_padded(*padded)
            error = max(max_error_to_peak(graphed[b, : n * hift.samples_per_frame].cpu(),
                                          eager[b, : n * hift.samples_per_frame].cpu()) for b, n in enumerate(lengths))
            report(f"HiFT bucket {rows} × {frames:3d}: max |graph - eager| / peak", error, GRAPH_VS_EAGER[torch.float32])
    eager_t2w = Token2Wav(flow, hift, mode="fast", flow_left_chunks=2)
    prompts, tokens = [], []
    for i in range(max_streams - 1):  # a padded stream bucket
        n = 30 + 11 * i
        prompts.append(FlowPrompt(torch.randint(0, hp["flow"]["vocab_size"], (1, n), generator=gen).to(device),
                                  torch.randn(1, 2 * n, 80, generator=gen).to(device, dtype),
                                  torch.randn(1, hp["spk_embed_dim"], generator=gen).to(device, dtype)))
        tokens.append(torch.randint(0, hp["flow"]["vocab_size"], (260,), generator=gen).tolist())

    def chunks(t2w: Token2Wav) -> list[list[torch.Tensor]]:
        """Each stream's first three chunks and a final one (50, 100, 200 and 206 tokens' frames)."""
        streams = [t2w.stream(p, zero_noise=True) for p in prompts]
        for stream, toks in zip(streams, tokens):
            stream.add(toks)
            stream.end()
        out: list[list[torch.Tensor]] = [[] for _ in streams]
        while requests := [(i, r) for i, s in enumerate(streams) if (r := s.next_chunk()) is not None]:
            for (i, _), audio in zip(requests, t2w.render([r for _, r in requests])):
                out[i].append(audio.float().cpu())
        return out

    began = time.perf_counter()
    at_buckets = chunks(bucketed)
    took = time.perf_counter() - began
    exact = chunks(eager_t2w)
    error = max(max_error_to_peak(torch.cat(b, dim=1), torch.cat(e, dim=1)) for b, e in zip(at_buckets, exact))
    report(f"{len(prompts)} streams' replies: max |at buckets - exact shapes| / peak", error, BATCH_VS_ALONE[dtype],
           f"  ({'graphs' if device.type == 'cuda' else 'eager'}: {took:.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=["released", "tiny"], default="released")
    parser.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"],
                        help="the serving dtype: graphs, syncs and the batched render run in it")
    parser.add_argument("--slots", type=int, default=64, help="the largest decode bucket checked")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        hp, lm, flow, hift = build(args.size, Path(tmp))
    lm, flow, hift = (cpu_weight_layout(m) for m in (lm, flow, hift))
    print(f"correctness on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{args.size} size, random weights, built in {time.perf_counter() - began:.1f} s", flush=True)
    check_half(hp, lm, flow, device)
    lm = lm.to(device, dtype)
    check_graphs(lm, device, args.slots)
    check_syncs(lm, device)
    check_batch_render(hp, flow, hift, device, dtype, lm=lm)
    check_render_graphs(hp, flow, hift, device, dtype)
    print(f"\ncorrectness: {'all PASS' if not failures else 'FAIL: ' + ', '.join(failures)}", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
