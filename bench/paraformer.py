"""Batched streaming Paraformer (voicebot/asr/sanm) against funasr's batch-1 streaming path.

    python bench/paraformer.py                       # released dimensions (220 M params), CPU
    python bench/paraformer.py --size tiny           # the tiny test model: overhead only
    python bench/paraformer.py --device cuda --dtype float16 --skip-funasr   # bench/gpu_check.sh's step
    python bench/paraformer.py --precision           # fp16, bf16, int8 against funasr's golden fixtures

One decode step (600 ms of audio per session, chunk [0, 10, 5], look-back 4/1) for 1, 4, 8 and 16
sessions: ours runs them as one model call (front end included), funasr one session after another
(generate() per session, each with its own cache). Sessions are warmed mid-utterance first, so
the look-back caches are full, as in a running show. Printed side by side:

  step ms      wall time until every session's chunk is decoded (p50 over --rounds)
  ms/chunk     step / sessions: the compute each session's 600 ms costs
  RTF/stream   step / 600 ms: each session waits the whole step, so >= 1 cannot keep up
  audio s/s    aggregate throughput, sessions * 0.6 s / step

"large" is a random-weight model with paraformer-large-online's exact dimensions, built once by
funasr's own classes into bench-output/ (880 MB); the compute per chunk is the real model's. With
--skip-funasr nothing of funasr is needed (the GPU box has none): the same dimensions get random
weights from our own classes, in memory. Timings on a shared machine are upper bounds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.asr.tiny_models import build_model_dir, synthetic_speech  # noqa: E402
from voicebot.models import is_complete  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "bench-output"
CHUNK = [0, 10, 5]
LOOK_BACK = (4, 1)
STRIDE = 9600  # samples per decode step with CHUNK
SESSIONS = (1, 4, 8, 16)


def p50(values: list[float]) -> float:
    return float(np.percentile(np.asarray(values) * 1000, 50))


def random_paraformer(size: str):
    """A LoadedParaformer of `size`'s dimensions (the config tests/asr/tiny_models.py writes for
    funasr) with random weights from our own classes, identity CMVN: no funasr, no files."""
    import torch

    from tests.asr.tiny_models import _paraformer_config, _tokens
    from voicebot.asr.sanm.frontend import Cmvn
    from voicebot.asr.sanm.loader import LoadedParaformer, check_config, frontend_config, model_args
    from voicebot.asr.sanm.model import Paraformer

    config, tokens = _paraformer_config("paraformer-streaming", size), _tokens(size)
    check_config(config)
    args = model_args(config, len(tokens))
    torch.manual_seed(0)
    cmvn = Cmvn(np.zeros(args.input_dim, np.float32), np.ones(args.input_dim, np.float32))
    return LoadedParaformer(Path(f"(random {size})"), Paraformer(args).eval(), frontend_config(config), cmvn, tokens, config)


def run_ours(loaded, audio: np.ndarray, rounds: int, warm: int, device: str, dtype: str) -> dict[int, float]:
    import torch

    from voicebot.asr.sanm.model import ChunkConfig
    from voicebot.asr.sanm.stream import StreamingParaformer

    loaded.model = loaded.model.to(device=device, dtype=getattr(torch, dtype))
    engine = StreamingParaformer(loaded, ChunkConfig(tuple(CHUNK), *LOOK_BACK))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    results = {}
    for n in SESSIONS:
        streams = [engine.open() for _ in range(n)]
        offsets = [(i * 7919 * 16) % (len(audio) // 2) for i in range(n)]  # sessions at different places
        times = []
        for r in range(warm + rounds):
            started = time.perf_counter()
            work = []
            for stream, offset in zip(streams, offsets):
                piece = audio[offset + r * STRIDE: offset + (r + 1) * STRIDE]
                work += [(stream, p) for p in stream.pieces(piece, False)]
            engine.step(work)
            sync()
            if r >= warm:
                times.append(time.perf_counter() - started)
        results[n] = p50(times)
    return results


def run_funasr(model_dir: Path, audio: np.ndarray, rounds: int, warm: int, device: str) -> dict[int, float]:
    from voicebot.asr.funasr_model import _patch_positional_encoding, load_automodel

    auto = load_automodel(model_dir, device, 1)
    _patch_positional_encoding()  # as the funasr engine runs it (O(chunk) positions)
    options = {"chunk_size": CHUNK, "encoder_chunk_look_back": LOOK_BACK[0], "decoder_chunk_look_back": LOOK_BACK[1]}
    results = {}
    for n in SESSIONS:
        caches = [{} for _ in range(n)]
        offsets = [(i * 7919 * 16) % (len(audio) // 2) for i in range(n)]
        times = []
        for r in range(warm + rounds):
            started = time.perf_counter()
            for cache, offset in zip(caches, offsets):
                piece = audio[offset + r * STRIDE: offset + (r + 1) * STRIDE]
                auto.generate(input=piece, cache=cache, is_final=False, key="bench", **options)
            if r >= warm:
                times.append(time.perf_counter() - started)
        results[n] = p50(times)
    return results


def precision() -> None:
    """Every golden case (tests/data/paraformer, made by funasr) in lower precisions against fp32:
    tokens equal to funasr's, and the largest encoder-output difference relative to its scale.
    The fixture model is micro and random: a trained model's margins between tokens differ."""
    import torch

    from voicebot.asr.sanm.loader import load_paraformer
    from voicebot.asr.sanm.model import ChunkConfig
    from voicebot.asr.sanm.stream import StreamingParaformer

    data = Path(__file__).resolve().parent.parent / "tests" / "data" / "paraformer"
    golden = torch.load(data / "golden.pt", weights_only=True)
    variants = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8 dynamic": "int8"}
    print(f"{'precision':>13} | {'tokens equal':>12} | {'max |enc diff| / max |enc|':>26}")
    for label, dtype in variants.items():
        loaded = load_paraformer(data / "model", dtype=torch.float32 if dtype == "int8" else dtype)
        if dtype == "int8":
            loaded.model = torch.ao.quantization.quantize_dynamic(loaded.model, {torch.nn.Linear}, dtype=torch.qint8)
        same = total = 0
        worst = 0.0
        for case in golden["cases"]:
            engine = StreamingParaformer(loaded, ChunkConfig(tuple(case["chunk_size"]), case["encoder_look_back"],
                                                             case["decoder_look_back"]))
            stream = engine.open()
            audio = golden["audio"][case["audio"]].numpy().astype(np.float32) / 32768
            fed, utterance = 0, 0
            for call in case["calls"]:
                if call["utterance"] != utterance:
                    fed, utterance = 0, call["utterance"]
                result = engine.feed(stream, audio[fed: fed + call["samples"]], call["final"])
                fed += call["samples"]
                for ours, theirs in zip(result.steps, call["steps"]):
                    total += max(len(ours.token_ids), len(theirs["token_ids"]))
                    same += sum(a == b for a, b in zip(ours.token_ids, theirs["token_ids"]))
                    ref = theirs["encoder_out"]
                    diff = (ours.encoder_out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-9)
                    worst = max(worst, diff)
        print(f"{label:>13} | {same:>5}/{total:<6} | {worst:26.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "large"), default="large")
    parser.add_argument("--rounds", type=int, default=8, help="timed steps per session count")
    parser.add_argument("--warm", type=int, default=6, help="untimed steps first (fills the look-back caches)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="ours only; funasr runs float32")
    parser.add_argument("--skip-funasr", action="store_true",
                        help="ours only, on random weights from our own classes (no funasr needed)")
    parser.add_argument("--precision", action="store_true", help="only: lower precisions against the golden fixtures")
    args = parser.parse_args()
    if args.precision:
        return precision()

    import torch

    torch.set_num_threads(args.threads)
    audio = synthetic_speech(60.0, seed=7)
    if args.skip_funasr:
        loaded = random_paraformer(args.size)
    else:
        import funasr  # noqa: F401  (registers funasr's classes, for building the model directory)

        from voicebot.asr.sanm.loader import load_paraformer

        model_dir = OUT / f"paraformer-streaming-{args.size}"
        if not is_complete(model_dir):
            started = time.perf_counter()
            build_model_dir(model_dir, "paraformer-streaming", size=args.size)
            print(f"built {model_dir} in {time.perf_counter() - started:.0f} s")
        loaded = load_paraformer(model_dir)

    ours = run_ours(loaded, audio, args.rounds, args.warm, args.device, args.dtype)
    theirs = {} if args.skip_funasr else run_funasr(model_dir, audio, args.rounds, args.warm, args.device)

    print(f"\n{args.size} model, {args.device} {args.dtype}, {args.threads} thread(s), chunk {CHUNK}, "
          f"look-back {LOOK_BACK}, p50 of {args.rounds} steps")
    print(f"{'sessions':>8} | {'ours: step ms':>13} {'ms/chunk':>9} {'RTF/stream':>10} {'audio s/s':>9} | "
          f"{'funasr: step ms':>15} {'ms/chunk':>9} {'RTF/stream':>10} {'audio s/s':>9}")
    for n in SESSIONS:
        row = f"{n:>8} | {ours[n]:13.1f} {ours[n] / n:9.1f} {ours[n] / 600:10.2f} {n * 600 / ours[n]:9.1f} | "
        if theirs:
            row += f"{theirs[n]:15.1f} {theirs[n] / n:9.1f} {theirs[n] / 600:10.2f} {n * 600 / theirs[n]:9.1f}"
        print(row)
    print(f"\nours, 16 sessions' step / 1 session's: {ours[16] / ours[1]:.2f}x (target <= 4x)")
    if theirs:
        print(f"throughput at 16 sessions, ours / funasr batch-1: {(16 / ours[16]) / (1 / theirs[1]):.2f}x (target >= 4x)")
        print(f"one session alone, ours / funasr: {ours[1] / theirs[1]:.2f}x the time (target <= 1x)")


if __name__ == "__main__":
    main()
