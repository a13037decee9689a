"""GPU proxies counted on CPU: kernel launches (aten calls) and host syncs per LM decode step and per
render, the bytes a stream holds as its reply grows, and what delays the first speech token (issue 24).

No GPU is needed to count what a GPU would be asked to do: bench/gpu_counts.py's `DeviceWork` (the
one counter the tests assert with too) sees every aten call the Python code makes (on a GPU each
non-view call is at least one kernel launch of several microseconds) and every call that makes the
host wait for the device (a read of a device value, an op sized by values, a blocking copy).

The models are built at the released depths (24 Qwen2 layers, 6 + 4 encoder layers, 1 + 12 + 1
estimator stages of 4 transformer blocks, HiFT's stages and ResBlocks) with narrow widths: the
counts follow the structure, not the width, and a CPU counts them in seconds. Bytes held per
stream are counted in mel frames held at this width and converted to the released width's bytes
(keys and values of every estimator attention layer, CFG pair, 10 Euler steps), fp16.

    python -m bench.gpu_proxy                          # this checkout
    python -m bench.gpu_proxy --ref /tmp/ref77         # beside an export of another revision:
        git -C /work/main archive 77c2663 | tar -x -C /tmp/ref77   (made first)
    python -m bench.gpu_proxy --device cuda            # the same counts on a GPU (bench/gpu_check.sh)
    python -m bench.gpu_proxy --only render,memory     # sections: lm, render, memory, first, window
    python -m bench.gpu_proxy --flow-left-chunks 2     # the eager renders' flow window (default: the code's)

Bucketed renders also print the bytes their copies write (gpu_counts.COPYING: copies, cats,
gathers, index selects and scatters), those the host launches and those inside the graphs, at the
proxy's width (fp32) and scaled to the released size's fp16 by the ratio of a stream state's bytes
(keys and values dominate both; the activations' copies scale by about half that).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)
from bench.gpu_counts import DeviceWork  # this checkout's counter, whichever checkout's code it counts

ROOT = Path(__file__).resolve().parent.parent


def _import_path(code: str | None) -> None:
    """Put the checkout whose code is counted first on sys.path (this one, or --code's)."""
    path = str(Path(code).resolve()) if code else str(ROOT)
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)


SPEECH_SECONDS = (5, 10, 30)
TOKENS_PER_SECOND = 25
N_PROMPT = 150  # voice prompt speech tokens (6 s), as bench/flow.py
STREAMS = (1, 8)
LM_ROWS = (1, 16, 64)
# a streamed reply as a responder writes it, one word at a time
REPLY = ("Sure, I can help with that. The first thing to check is whether the stream is live, "
         "and then we can look at the settings together.")


def hparams(fixtures: Path, tmp: Path) -> dict:
    """The fixture yaml at the released depths, narrow widths (module docstring)."""
    from voicebot.tts.cosyvoice2.hparams import load_hparams

    manifest = json.loads((fixtures / "manifest_full.json").read_text())
    qwen = dict(manifest["qwen2_config"], hidden_size=112, intermediate_size=256, vocab_size=512)  # 14 heads of 8
    (tmp / "config.json").write_text(json.dumps(qwen))
    h = load_hparams(fixtures, {"llm_input_size": 112, "llm_output_size": 112, "qwen_pretrain_path": str(tmp)})
    h["llm"]["speech_token_size"] = 6561
    h["flow"].update(input_size=64, vocab_size=6561)
    h["flow"]["encoder"].update(output_size=64, input_size=64, attention_heads=8, linear_units=128, num_blocks=6)
    h["flow"]["decoder"]["estimator"].update(channels=[64], attention_head_dim=8, n_blocks=4, num_mid_blocks=12,
                                             num_heads=8)
    h["hift"]["base_channels"] = 64
    h["hift"]["f0_predictor"]["cond_channels"] = 64
    return h


RELEASED_ESTIMATOR = {"heads": 8, "head_dim": 64, "n_blocks": 4, "num_mid_blocks": 12, "steps": 10}


def released_bytes_per_frame(elem: int = 2) -> int:
    """Keys and values of one mel frame in every estimator attention layer, CFG pair, all Euler steps."""
    r = RELEASED_ESTIMATOR
    n_attn = (2 + r["num_mid_blocks"]) * r["n_blocks"]
    return n_attn * 2 * 2 * r["heads"] * r["head_dim"] * r["steps"] * elem


def measure(args) -> dict:
    _import_path(args.code)
    import torch

    from voicebot.tts.cosyvoice2.flow import build_flow
    from voicebot.tts.cosyvoice2.hift import build_hift
    from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        hp = hparams(args.fixtures, Path(tmp))
        torch.manual_seed(0)
        flow, hift = build_flow(hp["flow"]).eval().to(device), build_hift(hp["hift"]).eval().to(device)
        if "lm" in args.only:
            out.update(measure_lm(hp, device))
        if "first" in args.only:
            out.update(measure_first_token(hp, device))
    window = {} if args.flow_left_chunks is None else {"flow_left_chunks": args.flow_left_chunks}
    try:
        t2w = Token2Wav(flow, hift, **window)
    except TypeError:
        if window:
            raise SystemExit(f"{args.code or ROOT}: Token2Wav takes no flow_left_chunks")
        t2w = Token2Wav(flow, hift)
    g = torch.Generator().manual_seed(0)
    vocab = flow.input_embedding.num_embeddings

    def voice(seed: int) -> FlowPrompt:
        g.manual_seed(seed)
        return FlowPrompt(torch.randint(0, vocab, (1, N_PROMPT), generator=g, dtype=torch.int32).to(device),
                          torch.randn(1, 2 * N_PROMPT, 80, generator=g).to(device),
                          torch.randn(1, 192, generator=g).to(device))

    def tokens(n: int, seed: int) -> list[int]:
        g.manual_seed(1000 + seed)
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    if "render" in args.only:
        renderers = [("", t2w)]
        try:  # flow and HiFT at bucketed shapes, each bucket's work one graph replay on CUDA
            renderers.append((", bucketed (graphs)", Token2Wav(flow, hift, flow_left_chunks=BUCKETED_WINDOW, bucketed=True)))
        except TypeError:  # a revision from before them (--ref)
            pass
        for label, renderer in renderers:
            voices = [voice(0), voice(1)]
            for v in voices:
                renderer.prompt_state(v)
            for n in STREAMS:
                streams = [renderer.stream(voices[i % 2], generator=torch.Generator(device).manual_seed(i))
                           for i in range(n)]
                for i, s in enumerate(streams):
                    s.add(tokens(400, i))
                for chunk in ("first", "second"):
                    requests = [s.next_chunk() for s in streams]
                    with DeviceWork() as c, graph_replays(c) as in_graphs:
                        renderer.render(requests)
                    name = f"{chunk} chunk, {n} stream{'s' * (n > 1)}{label}"
                    out[f"render {name}"] = (c.calls, c.total_syncs)
                    if label:  # the bytes copies write: launched by the host, in the graphs; at released size
                        scale = released_bytes_per_frame() / RELEASED_ESTIMATOR["steps"] / (state_bytes_per_frame(flow) * 4)
                        out[f"MB copies wrote, {name}: host-launched + in graphs"] = (
                            f"{c.copied / 1e6:.1f} + {in_graphs.copied / 1e6:.1f}", None)
                        out[f"GB copies wrote, {name}, released size fp16 (× {scale:.0f}, the state's ratio)"] = (
                            f"{c.copied * scale / 1e9:.2f} + {in_graphs.copied * scale / 1e9:.2f}", None)
    if "window" in args.only:
        out.update(measure_window(args.fixtures))
    if "memory" in args.only:
        per_frame = state_bytes_per_frame(flow)
        holders = [("", t2w)]
        try:  # a bucketed stream's state: its window's tensors (what it holds whatever it has held)
            holders.append((", bucketed", Token2Wav(flow, hift, flow_left_chunks=BUCKETED_WINDOW, bucketed=True)))
        except TypeError:  # a revision from before them (--ref)
            pass
        for label, holder in holders:
            stream = holder.stream(voice(0), generator=torch.Generator(device).manual_seed(0))
            stream.add(tokens(max(SPEECH_SECONDS) * TOKENS_PER_SECOND + 10, 0))
            for seconds in SPEECH_SECONDS:
                while (r := stream.next_chunk()) is not None and r.n_tokens <= seconds * TOKENS_PER_SECOND:
                    holder.render([r])
                state = stream.flow_cache
                if hasattr(state, "steps"):  # a FlowCache: per Euler step, per layer
                    held = sum(t.numel() for step in state.steps for t in (*step.keys, *step.values) if t is not None)
                    frames = held / per_frame / len(state.steps)
                elif hasattr(state, "keys"):  # a WindowState: (steps, layers, CFG pair, heads, frames, head_dim)
                    frames = state.keys.shape[-2]
                else:  # a SlotState: its slot of the pool, a window's frames
                    frames = holder.window_flow.window
                out[f"flow frames held per stream after {seconds} s{label}"] = (round(frames), None)
                out[f"MB held per stream after {seconds} s (released, fp16){label}"] = (
                    round(frames * released_bytes_per_frame() / 1e6, 1), None)
    return out


def state_bytes_per_frame(flow) -> int:
    """Keys and values of one mel frame in every estimator attention layer, CFG pair, one Euler
    step, in elements (the proxy's width)."""
    attn = flow.decoder.estimator.down_blocks[0][1][0].attn1
    n_attn = sum(isinstance(m, type(attn)) for m in flow.decoder.estimator.modules())
    return n_attn * 2 * 2 * attn.heads * attn.head_dim


WINDOWS = (0, 1, 2, 4)
BUCKETED_WINDOW = 2  # bucketed shapes need a bounded flow window: the render rows' in chunks


@contextlib.contextmanager
def graph_replays(counter: DeviceWork):
    """While counting: a bucket's work (graphs.BucketGraphs.run) counted as what the host launches
    on CUDA, where it is a captured graph: the inputs' copies into the static ones and one replay
    (the caller's copies of the outputs are counted as they run). Its captured work's launches are
    not counted; the bytes its copies write are, in the DeviceWork it yields. No-op for a revision
    without it."""
    in_graphs = DeviceWork()
    try:
        from voicebot.tts.cosyvoice2.graphs import BucketGraphs
    except ModuleNotFoundError:
        yield in_graphs
        return
    from torch.utils._python_dispatch import _disable_current_modes

    def run(self, bucket, inputs):
        with _disable_current_modes(), in_graphs:
            outputs = self.fn(*inputs)
        counter.calls += len(inputs) + 1  # the copies in, the replay
        counter.copied += sum(x.numel() * x.element_size() for x in inputs)
        return outputs

    original = BucketGraphs.run
    BucketGraphs.run = run
    try:
        yield in_graphs
    finally:
        BucketGraphs.run = original


def measure_window(fixtures: Path) -> dict:
    """How far a left-context window moves the chunk-causal mel (the cached stream's, whose
    non-final chunks every mode uses) from the unbounded one, on the golden fixture's weights and
    utterance (12 prompt + 120 tokens) and on a 600-token random one: max |difference| and that as
    a fraction of the unbounded mel's peak. Needs the code's flow_left_chunks (this checkout's)."""
    import torch
    from safetensors.torch import load_file

    from voicebot.tts.cosyvoice2.flow import build_flow
    from voicebot.tts.cosyvoice2.hparams import load_hparams
    from voicebot.tts.cosyvoice2.loader import load_checkpoint

    flow = build_flow(load_hparams(fixtures)["flow"]).eval()
    load_checkpoint(flow, fixtures / "flow.pt")
    g = load_file(fixtures / "golden.safetensors")
    prompt = (g["flow.prompt_token"], g["flow.prompt_feat"], g["flow.embedding"])
    gen = torch.Generator().manual_seed(0)
    long = torch.randint(0, flow.input_embedding.num_embeddings, (1, 600), generator=gen, dtype=torch.int32)
    out = {}
    for name, tokens in (("golden", g["flow.token"]), ("600 tokens", long)):
        ref = flow.inference(tokens, *prompt, streaming=True, finalize=True)
        peak = ref.abs().max()
        for left in WINDOWS:
            diff = (flow.inference(tokens, *prompt, True, True, left_chunks=left) - ref).abs().max()
            out[f"mel vs unbounded, window {left}, {name}: max abs / of peak"] = (
                f"{diff:.3g} / {diff / peak:.2%}", None)
    return out


def measure_lm(hp: dict, device) -> dict:
    import torch

    try:
        from voicebot.tts.cosyvoice2.lm_pool import LMPool
    except ModuleNotFoundError:  # a revision from before the pool moved beside the LM (--ref)
        from voicebot.serving.lm_pool import LMPool
    from voicebot.tts.cosyvoice2.lm import build_lm, unistream
    from voicebot.tts.cosyvoice2.sampling import RasSampler

    lm = build_lm(hp).eval().to(device)
    out = {}
    for n in LM_ROWS:
        pool = LMPool(lm, n, 256, prepack=False)
        rows = []
        for i in range(n):
            row = pool.open(RasSampler(generator=torch.Generator(device).manual_seed(i)))
            pool.start(row, unistream(lm, 256, list(range(10 + i, 40 + i)), [1, 2, 3], [4, 5, 6]))
            while row.waiting > 1:
                pool.prefill(row)
            rows.append(row)
        pool.decode(rows)  # one step after the prefill, so every row waits on one position
        with DeviceWork() as c:
            pool.decode(rows)
        out[f"LM decode step, {n} row{'s' * (n > 1)}"] = (c.calls, c.total_syncs)
    return out


def measure_first_token(hp: dict, device) -> dict:
    """What stands between the first reply word and the first speech token: the reply words the
    synthesizer's text feed holds before it pushes text (bistream_text.WordFeed: a word once the
    next space follows it; a revision without it: its sentence segmenter, a sentence at a time), and
    the text tokens the bistream LM needs before it may emit speech (its prompt speech is
    interleaved 15 to 5 text)."""
    import torch

    from voicebot.tts.cosyvoice2.bistream import Bistream
    from voicebot.tts.cosyvoice2.lm import build_lm, run_alone
    from voicebot.tts.cosyvoice2.sampling import RasSampler
    try:
        from voicebot.tts.cosyvoice2.bistream_text import WordFeed as feed
    except ModuleNotFoundError:  # a revision from before it (--ref)
        from voicebot.tts.segmenter import SentenceSegmenter as feed

    words = REPLY.split(" ")
    text = feed()
    held = next((i + 1 for i, w in enumerate(words) if text.push(w + " ")), len(words))
    lm = build_lm(hp).eval().to(device)
    cache = lm.new_cache(1024)
    g = torch.Generator(device).manual_seed(0)
    bistream = Bistream(lm, 1024, list(range(20)), list(range(N_PROMPT)))
    sampler = RasSampler(generator=g)
    n_text = 0
    while n_text < 200:
        n_text += 1
        if any(True for _ in run_alone(lm, cache, sampler, bistream.push([100 + n_text]))):
            break
    return {"reply words held before the LM gets text": (held, None),
            f"text tokens pushed before the first speech token ({N_PROMPT}-token prompt)": (n_text, None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fixtures", type=Path, default=ROOT / "tests" / "data" / "cosyvoice2")
    parser.add_argument("--only", default="lm,render,memory,first,window",
                        help="comma-separated sections: lm,render,memory,first,window")
    parser.add_argument("--flow-left-chunks", type=int, default=None,
                        help="the flow cache's left-context window in chunks (-1 all; default: the code's default)")
    parser.add_argument("--ref", help="an export of another revision, counted beside this one")
    parser.add_argument("--code", help=argparse.SUPPRESS)  # the checkout whose voicebot is counted
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.only = set(args.only.split(","))
    if args.json:
        print(json.dumps(measure(args)))
        return
    columns = {}
    if args.ref:
        cmd = [sys.executable, "-m", "bench.gpu_proxy", "--json", "--code", args.ref, "--device", args.device,
               "--threads", str(args.threads), "--fixtures", str(args.fixtures),
               "--only", ",".join(args.only - {"window"})]  # the window is this checkout's
        env = dict(os.environ, PYTHONPATH=str(ROOT))  # bench from here; voicebot from --code (_import_path)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if done.returncode:
            raise SystemExit(f"counting {args.ref} failed:\n{done.stderr}")
        ref = done.stdout
        columns[f"ref {Path(args.ref).name}"] = json.loads(ref.strip().splitlines()[-1])
    columns["this"] = measure(args)
    names = list(dict.fromkeys(k for col in columns.values() for k in col))
    width = max(map(len, names)) + 2
    print(f"GPU proxies on {args.device}, released depths, narrow widths"
          f"{'' if args.flow_left_chunks is None else f', flow_left_chunks {args.flow_left_chunks}'}")
    print(f"{'':{width}}" + "".join(f"{c:>22}" for c in columns))
    for name in names:
        cells = []
        for col in columns.values():
            calls, syncs = col.get(name, (None, None))
            cells.append("—" if calls is None else str(calls) if isinstance(calls, str) else f"{calls:,}"
                         if syncs is None else f"{calls:,} / {syncs} syncs")
        print(f"{name:{width}}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
