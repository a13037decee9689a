"""CosyVoice 2 speed on this machine, beside the official code's figures (shared/specs/cosyvoice2-cpu-baseline.md).

Released module sizes with random weights (dense fp32 timing does not depend on the values), the
baseline's zero-shot shapes: 30 prompt-text + 20 text tokens, 150 prompt speech tokens (6 s),
300 prompt mel frames, exactly 125 generated tokens (5 s of audio). Measures LM prefill, the decode
step, time to the first 200 ms of audio and the real-time factor streaming (through the engine's
own step loop, in each token2wav mode: the official "recompute" from a full LM prefill, "exact" and
"fast" from the voice's cached LM prompt prefix) and non-streaming, the voice's flow prompt state,
and peak memory; then the int8 LM (voicebot/tts/cosyvoice2/quant.py) in the exact and fast modes,
each mode also with LM decoding overlapped with flow + HiFT on two threads after the first chunk
(overlap.py, column "+ovl"), the fast mode's final-chunk deviation from exact, and one table of the
modes side by side with the issue's targets.

    python -m bench.cosyvoice2                 # released sizes: minutes of 2 busy cores; run it rarely
    python -m bench.cosyvoice2 --size tiny     # the fixture model's sizes: a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import resource
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)
from voicebot.config.base import REPO_ROOT
from voicebot.config.engines import Cosyvoice2Config
from voicebot.tts.cosyvoice2.lm_pool import LMPool
from voicebot.serving.scheduler import Scheduler
from voicebot.tts.cosyvoice2.speech_job import PlaybackClock, SpeechJob
from voicebot.tts.cosyvoice2.voice_prompts import flow_prompt
from voicebot.tts.cosyvoice2.flow import build_flow
from voicebot.tts.cosyvoice2.hift import build_hift
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.loader import cpu_weight_layout
from voicebot.tts.cosyvoice2.lm import PromptPrefix, build_lm, build_lm_input, generate, prompt_prefix, unistream
from bench.overlap import overlapped
from voicebot.tts.cosyvoice2.quant import decode_weight_bytes, quantize_lm
from voicebot.tts.cosyvoice2.sampling import RasSampler
from voicebot.tts.cosyvoice2.token2wav import Token2Wav
from voicebot.tts.cosyvoice2.voices import Voice

FIXTURES = REPO_ROOT / "tests" / "data" / "cosyvoice2"
N_PROMPT_TEXT, N_TEXT, N_PROMPT_SPEECH, N_GENERATED = 30, 20, 150, 125
SAMPLES_PER_TOKEN = 960
AUDIO_SECONDS = N_GENERATED * SAMPLES_PER_TOKEN / 24000

# The official code's figures from the baseline file's last section, measured on another machine
# on another day: every print of them names OFFICIAL_CPU beside this run's CPU, since a ratio
# across CPUs is not a speed-up (the older Zen 3 figures, 30.5 s and RTF 15, overstated ours).
OFFICIAL_CPU = "AMD EPYC Zen 4 (AVX-512), 2 threads, 2026-12-01"
OFFICIAL = {
    "LM prefill, L=202 (s)": 1.46,
    "LM decode step (ms)": 151.6,
    "first chunk step (s)": 10.8,  # ≈: flow chunk 1 + HiFT 1 s, as ours
    "HiFT, 1 s of mel (s)": 0.22,
    "streaming: first audio (s)": 23.9,
    "streaming: RTF": 10.99,
    "non-streaming flow, 5 s (s)": 16.28,
    "peak RSS (GB)": 5.04,
}
# Issue 7's targets on this 2-core CPU, fp32 unless int8: (column, row) -> bound.
TARGETS = {(f"{mode}{ovl}", row): bound for ovl in ("", "+ovl") for mode, row, bound in [
    ("exact", "first audio (s)", 7.0), ("fast", "RTF", 5.0), ("exact+int8", "first audio (s)", 4.5),
    ("fast+int8", "first audio (s)", 4.5), ("fast+int8", "RTF", 3.5)]}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def released_hparams(fixtures: Path, qwen_dir: Path) -> dict:
    """The fixture yaml with the released sizes (the fixture README lists every size that differs)."""
    manifest = json.loads((fixtures / "manifest_full.json").read_text())
    (qwen_dir / "config.json").write_text(json.dumps(manifest["qwen2_config"]))
    h = load_hparams(fixtures, {"llm_input_size": 896, "llm_output_size": 896, "qwen_pretrain_path": str(qwen_dir)})
    h["llm"]["speech_token_size"] = 6561
    h["flow"].update(input_size=512, vocab_size=6561)
    h["flow"]["encoder"].update(output_size=512, input_size=512, attention_heads=8, linear_units=2048, num_blocks=6)
    h["flow"]["decoder"]["estimator"].update(channels=[256], attention_head_dim=64, n_blocks=4, num_mid_blocks=12,
                                             num_heads=8)
    h["hift"]["base_channels"] = 512
    h["hift"]["f0_predictor"]["cond_channels"] = 512
    return h


class Rows(dict):
    """Measurements by name, each printed beside the official figure as soon as it is taken: a
    released-size run takes many minutes, and a partial run should still say something."""

    def __init__(self, released: bool) -> None:
        super().__init__()
        self.released = released
        print(f"\nours: {cpu_model()}, this run; official: {OFFICIAL_CPU}; ratio = official there / ours here",
              flush=True)
        print(f"{'measurement':50s} {'ours':>10s} {'official':>10s} {'ratio':>7s}", flush=True)

    def __setitem__(self, name: str, value: float) -> None:
        super().__setitem__(name, value)
        ref = OFFICIAL.get(re.sub(r" \[\w+\]", "", re.sub(r"L=\d+", "L=202", name)))
        ratio = f"{ref / value:6.2f}x" if ref and self.released else ""
        print(f"{name:50s} {value:10.3f} {ref if ref is not None else '':>10} {ratio:>7s}", flush=True)


def timed(fn, n: int = 1) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(n):
        start = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # CUDA work is asynchronous: time it to its end
        times.append(time.perf_counter() - start)
    return times, out


def fixed_length_ras(hparams: dict, eos: int, generator: torch.Generator):
    """Official RAS, with every stop id masked until N_GENERATED tokens, then eos: random weights
    would otherwise stop at a random length (the baseline forced 125 tokens the same way)."""
    ras = RasSampler.from_hparams(hparams["llm"]["sampling"], generator)

    def sample(logp: torch.Tensor, history) -> int:
        return ras(logp[:eos], history) if len(history) < N_GENERATED else eos

    return sample


def timed_render(token2wav: Token2Wav):
    """The scheduler's render function, timed: its seconds per call in `.seconds`."""
    seconds: list[float] = []

    def render(chunks):
        began = time.perf_counter()
        audio = [a.reshape(-1).float().cpu().numpy() for a in token2wav.render(chunks)]
        seconds.append(time.perf_counter() - began)
        return audio

    render.seconds = seconds
    return render


def stream_once(engine: SimpleNamespace, scheduler: Scheduler, voice: Voice, text: list[int],
                prefix: PromptPrefix | None) -> tuple[float, float, float, list[int], np.ndarray]:
    """One utterance through the engine's step loop (SpeechJob.chunks on the scheduler thread), from
    the voice's LM prompt prefix (as the engine starts) or from nothing: (first chunk's flow + HiFT
    s, first 200 ms of audio s, RTF, tokens, the audio of the last chunk)."""
    generator = torch.Generator(engine.device).manual_seed(1)
    sampler = fixed_length_ras(engine.hparams, engine.lm.eos, generator)
    renders = scheduler.renders.render.seconds
    renders.clear()

    def start(row):
        scheduler.pool.start(row, unistream(engine.lm, scheduler.pool.max_seq_len, text, voice.prompt_text,
                                            voice.lm_prompt_speech, prefix=prefix))
        return engine.token2wav.stream(flow_prompt(voice, engine.device, engine.dtype), generator=generator)

    async def run():
        row = await scheduler.open_row(sampler, prefix, 0)
        utterance = SpeechJob(scheduler, row, await scheduler.call(lambda: start(row), 0), PlaybackClock())
        start_time, first_audio, audio, last = time.perf_counter(), None, 0, None
        try:
            async for piece in utterance.chunks(finish=True):
                audio += len(piece)
                last = piece
                if first_audio is None and audio >= 4800:  # 200 ms at 24 kHz
                    first_audio = time.perf_counter() - start_time
        finally:
            utterance.close()
        assert audio == N_GENERATED * SAMPLES_PER_TOKEN, audio
        return first_audio, (time.perf_counter() - start_time) / AUDIO_SECONDS, list(utterance.stream.tokens), last

    first_audio, rtf, tokens, last = asyncio.run(run())
    return renders[0], first_audio, rtf, tokens, last


def stream_overlapped(engine: SimpleNamespace, cache, voice: Voice, text: list[int], mode: str,
                      prefix: PromptPrefix) -> tuple[float, float, float]:
    """One utterance with the LM on a background thread (overlap.py): (first chunk s, first 200 ms s, RTF).

    The sampler and the vocoder noise get their own generators: the two threads draw concurrently.
    """
    sampler = fixed_length_ras(engine.hparams, engine.lm.eos, torch.Generator(engine.device).manual_seed(1))
    tokens = generate(engine.lm, cache, sampler, text, voice.prompt_text, voice.lm_prompt_speech, prefix=prefix)
    stream = engine.token2wav.stream(flow_prompt(voice, engine.device, engine.dtype),
                                     generator=torch.Generator(engine.device).manual_seed(2), mode=mode)
    start, first_chunk, first_audio, audio = time.perf_counter(), None, None, 0
    for chunk in overlapped(tokens, stream):
        audio += chunk.shape[1]
        first_chunk = first_chunk or time.perf_counter() - start
        if first_audio is None and audio >= 4800:
            first_audio = time.perf_counter() - start
    assert audio == N_GENERATED * SAMPLES_PER_TOKEN, audio
    return first_chunk, first_audio, (time.perf_counter() - start) / AUDIO_SECONDS


def gemm_rate(device: torch.device, dtype: torch.dtype, n: int = 1024) -> float:
    """GFLOP/s of a large square matmul: what the cores can do at best."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    times, _ = timed(lambda: a @ a, 10)
    return 2 * n**3 / min(times) / 1e9


def read_rate(device: torch.device, gigabytes: float = 1.0) -> float:
    """GB/s of summing a tensor much larger than the caches: the memory bandwidth a decode step can use."""
    x = torch.ones(int(gigabytes * 1e9) // 4, device=device)
    times, _ = timed(lambda: x.sum(), 5)
    return gigabytes / min(times)


def rel_l2(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["released", "tiny"], default="released")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the baseline used 2)")
    parser.add_argument("--fixtures", type=Path, default=FIXTURES)
    parser.add_argument("--modes", default="recompute,exact,fast", help="token2wav stream modes to run")
    parser.add_argument("--int8-modes", default="exact,fast", help="modes to run again with the int8 LM ('' for none)")
    parser.add_argument("--overlap-modes", default="exact,fast",
                        help="modes to run again, fp32 and int8, with the LM overlapped ('' for none)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (bench/gpu_check.sh)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="LM and flow precision (HiFT always runs in float32)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        hp = released_hparams(args.fixtures, Path(tmp)) if args.size == "released" else load_hparams(args.fixtures)
        start = time.perf_counter()
        lm, flow, hift = build_lm(hp).eval(), build_flow(hp["flow"]).eval(), build_hift(hp["hift"]).eval()
        lm, flow, hift = (cpu_weight_layout(m) for m in (lm.to(device, dtype), flow.to(device, dtype), hift.to(device)))
    print(f"built {args.size} modules with random weights in {time.perf_counter() - start:.1f} s, "
          f"{args.threads} threads, {device} {args.dtype}")
    token2wav = Token2Wav(flow, hift)
    n_speech, vocab = lm.speech_token_size, lm.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    voice = Voice(
        name="bench", source="random", transcript="",
        prompt_text=torch.randint(0, vocab, (1, N_PROMPT_TEXT), generator=g, dtype=torch.int32).to(device),
        lm_prompt_speech=(prompt_speech := torch.randint(0, n_speech, (1, N_PROMPT_SPEECH), generator=g,
                                                         dtype=torch.int32).to(device)),
        flow_prompt_speech=prompt_speech,
        prompt_feat=torch.randn(1, 2 * N_PROMPT_SPEECH, 80, generator=g).to(device),
        embedding=torch.randn(1, 192, generator=g).to(device),
    )
    text = torch.randint(0, vocab, (N_TEXT,), generator=g).tolist()
    cache = lm.new_cache(1024)
    rows = Rows(args.size == "released")

    with torch.inference_mode():
        x = build_lm_input(lm, torch.tensor(text, device=device), voice.prompt_text[0].long(), prompt_speech[0].long())
        pos = torch.arange(x.shape[1], device=device)
        lm(x, pos, cache)  # warm-up
        prefill, _ = timed(lambda: lm(x, pos, cache), 3)
        prefill_time = rows[f"LM prefill, L={x.shape[1]} (s)"] = statistics.median(prefill)
        step_x = lm.speech_embedding.weight[:1].reshape(1, 1, -1)
        steps, _ = timed(lambda: lm(step_x, pos[-1:] + 1, cache), 20)
        rows["LM decode step (ms)"] = 1000 * statistics.median(steps)
        # A decode step streams the decoder weights once: compare its rate with a plain read.
        rows["LM decode: weights read GB/s"] = decode_weight_bytes(lm) / statistics.median(steps) / 1e9
        rows["this machine: memory read GB/s"] = read_rate(device)
        prefix = prompt_prefix(lm, voice.prompt_text)
        n = prefix.length
        prefill, _ = timed(lambda: lm(x[:, n:], pos[n:], cache), 3)
        rows[f"LM prefill after the voice's {n}-token prefix (s)"] = statistics.median(prefill)
        hift_1s, _ = timed(lambda: hift.inference(torch.randn(1, 80, 50, device=device)), 2)
        rows["HiFT, 1 s of mel (s)"] = min(hift_1s)

    # Streaming, through the engine's own step loop (LM steps and flow/HiFT chunks on one thread),
    # in each token2wav mode; exact and fast share the voice's flow prompt state, made once up front.
    engine = SimpleNamespace(device=device, dtype=dtype, hparams=hp, lm=lm, token2wav=token2wav,
                             config=Cosyvoice2Config())
    prompt = flow_prompt(voice, engine.device, engine.dtype)
    scheduler = Scheduler("bench", LMPool(lm, 1, 1024), timed_render(token2wav))
    scheduler.start()
    # the last HiFT input of each run: the final chunk's mel (with the 8 overlap frames before it)
    last_mel: dict[str, torch.Tensor] = {}
    excitations = hift.excitations
    hift.excitations = lambda requests: (last_mel.__setitem__(token2wav.mode, requests[-1].f0_mel),
                                         excitations(requests))[1]
    streams: dict[str, tuple[float, float, float]] = {}
    last_chunk: dict[str, np.ndarray] = {}
    for mode in args.modes.split(","):
        if mode != "recompute" and not token2wav.prompt_state_bytes():
            state_time, _ = timed(lambda: token2wav.prompt_state(prompt))
            rows["flow prompt state, 6 s prompt (s)"] = state_time[0]
            rows["flow prompt state (GB)"] = sum(token2wav.prompt_state_bytes().values()) / 1e9
        token2wav.mode = mode
        # the official algorithm prefills the whole LM input; the others start from the voice's prefix
        first_step, first_audio, rtf, tokens, last_chunk[mode] = stream_once(
            engine, scheduler, voice, text, None if mode == "recompute" else prefix)
        streams[mode] = first_audio, rtf, first_step
        rows[f"first chunk step [{mode}] (s)"] = first_step
        rows[f"streaming [{mode}]: first audio (s)"] = first_audio
        rows[f"streaming [{mode}]: RTF"] = rtf
    overlap_modes = [m for m in args.overlap_modes.split(",") if m]
    for mode in overlap_modes:
        first_step, first_audio, rtf = stream_overlapped(engine, cache, voice, text, mode, prefix)
        streams[f"{mode}+ovl"] = first_audio, rtf, first_step
        rows[f"streaming [{mode}+ovl]: first audio (s)"] = first_audio
        rows[f"streaming [{mode}+ovl]: RTF"] = rtf
    del hift.excitations  # the streaming runs' HiFT inputs only

    # Non-streaming: the same tokens (the sampler is seeded), one flow and one HiFT pass; its
    # matmul/conv FLOPs (attention's are not counted) against this machine's fp32 GEMM rate give
    # the flow's floor here.
    tokens = torch.tensor([tokens], device=device)
    with FlopCounterMode(display=False) as flops:
        flow_time, mel = timed(lambda: flow.inference(tokens, prompt.token, prompt.feat, prompt.embedding,
                                                      streaming=False, finalize=True))
    n_frames = mel.shape[2] + prompt.feat.shape[1]
    rows["flow matmul+conv GFLOP per mel frame"] = flops.get_total_flops() / n_frames / 1e9
    rows["flow GFLOP/s, non-streaming"] = flops.get_total_flops() / flow_time[0] / 1e9
    rows[f"this machine: {args.dtype} GEMM GFLOP/s"] = gemm_rate(device, dtype)
    with torch.inference_mode():
        hift_time, _ = timed(lambda: hift.inference(mel.float()))
    rows["non-streaming flow, 5 s (s)"] = flow_time[0]
    lm_time = prefill_time + N_GENERATED * rows["LM decode step (ms)"] / 1000
    rows["non-streaming: RTF (LM + flow + HiFT)"] = (lm_time + flow_time[0] + hift_time[0]) / AUDIO_SECONDS
    if {"exact", "fast"} <= last_mel.keys():
        # same tokens and noise draws in both modes: only the final chunk's flow differs
        # the modes' vocoders take different context frames before the final chunk's: compare the end
        frames = min(last_mel["fast"].shape[2], last_mel["exact"].shape[2])
        fast_mel, exact_mel = last_mel["fast"][:, :, -frames:], last_mel["exact"][:, :, -frames:]
        rows["fast vs exact, final chunk mel: rel L2"] = rel_l2(fast_mel, exact_mel)
        rows["fast vs exact, final chunk mel: max abs"] = float((fast_mel - exact_mel).abs().max())
        # fast's vocoder holds back more audio, so its last chunk is longer: compare the utterance's
        # end, where both last chunks lie
        tail = min(len(last_chunk["fast"]), len(last_chunk["exact"]))
        rows["fast vs exact, final chunk audio: rel L2"] = rel_l2(last_chunk["fast"][-tail:], last_chunk["exact"][-tail:])
    rows["peak RSS, fp32 (GB)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6

    # The int8 LM (decode-step linears except down_proj; prefill stays fp32), in place from here on.
    int8_modes = [m for m in args.int8_modes.split(",") if m]
    if int8_modes:
        fp32_bytes = decode_weight_bytes(lm)
        quantize_lm(lm)
        rows["LM decode weights fp32 (GB)"] = fp32_bytes / 1e9
        rows["LM decode weights int8 (GB)"] = decode_weight_bytes(lm) / 1e9
        with torch.inference_mode():
            lm(x, pos, cache)
            steps, _ = timed(lambda: lm(step_x, pos[-1:] + 1, cache), 20)
        rows["LM decode step [int8] (ms)"] = 1000 * statistics.median(steps)
        rows["LM decode [int8]: weights read GB/s"] = decode_weight_bytes(lm) / statistics.median(steps) / 1e9
    for mode in int8_modes:
        token2wav.mode = mode
        first_step, first_audio, rtf, _, _ = stream_once(engine, scheduler, voice, text, prefix)
        streams[f"{mode}+int8"] = first_audio, rtf, first_step
        rows[f"streaming [{mode}+int8]: first audio (s)"] = first_audio
        rows[f"streaming [{mode}+int8]: RTF"] = rtf
    for mode in overlap_modes if int8_modes else []:
        first_step, first_audio, rtf = stream_overlapped(engine, cache, voice, text, mode, prefix)
        streams[f"{mode}+int8+ovl"] = first_audio, rtf, first_step
        rows[f"streaming [{mode}+int8+ovl]: first audio (s)"] = first_audio
        rows[f"streaming [{mode}+int8+ovl]: RTF"] = rtf
    rows["peak RSS (GB)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    if device.type == "cuda":
        rows["peak GPU memory (GB)"] = torch.cuda.max_memory_allocated() / 1e9
    rows["flow prompt states held (GB)"] = sum(token2wav.prompt_state_bytes().values()) / 1e9

    scheduler.stop()
    print(f"\nratio = official / ours (higher is faster). Official figures: shared/specs/cosyvoice2-cpu-baseline.md,"
          f" measured on {OFFICIAL_CPU}; ours on {cpu_model()} in this run, whose cores may be shared: a ratio"
          f" across two CPUs is not a speed-up.")
    print_side_by_side(streams, args.size == "released")


def print_side_by_side(streams: dict[str, tuple[float, float, float]], released: bool) -> None:
    """Streaming 5 s of speech: the official figures, our recompute algorithm, and the modes, with targets."""
    official = {"first audio (s)": OFFICIAL["streaming: first audio (s)"], "RTF": OFFICIAL["streaming: RTF"],
                "first chunk step (s)": OFFICIAL["first chunk step (s)"]}
    names = list(official)
    print(f"\nstreaming, 5 s of speech; official: {OFFICIAL_CPU}; ours: {cpu_model()}")
    print(f"{'':24s} {'official':>9s}" + "".join(f" {c:>14s}" for c in streams))
    for i, name in enumerate(names):
        cells = "".join(f" {v[i]:14.2f}" for v in streams.values())
        print(f"{name:24s} {official[name]:9.2f}{cells}")
        if released:
            print(f"{'  official / ours':24s} {'':9s}" + "".join(f" {official[name] / v[i]:13.2f}x" for v in streams.values()))
        if "recompute" in streams:
            base = streams["recompute"][i]
            print(f"{'  recompute / ours':24s} {'':9s}" + "".join(f" {base / v[i]:13.2f}x" for v in streams.values()))
        targets = {c: TARGETS.get((c, name)) for c in streams}
        if any(targets.values()):
            marks = "".join(f" {'' if t is None else ('<= %g ' % t) + ('ok' if streams[c][i] <= t else 'MISS'):>14s}"
                            for c, t in targets.items())
            print(f"{'  target':24s} {'':9s}{marks}")


if __name__ == "__main__":
    main()
