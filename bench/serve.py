"""Many speaking sessions through the real CosyVoice 2 engine and scheduler, batched and not.

N simulated sessions (default 1, 2, 4, 8, 16, 32) each speak real reply text at a duty cycle (30 %
of the time speaking): the text arrives word by word as from a fast LLM, a listener plays the audio
in real time. Per N, printed as measured: first audio after the reply text arrives (p50/p95),
underruns (a chunk arriving after the listener ran out), real-time factor per stream, aggregate
seconds of speech per wall second, the batch-size histograms (LM steps, flow/HiFT renders) and
deadline misses, sessions cut by the pass's timeout (and on CUDA the pass's peak GPU memory); then
the same runs with batching off (every LM row and every chunk alone: today's cost) and the ratios.
A pass runs for `--seconds` of wall time, or, with `--replies K`, until every session has spoken K
replies (bounded by work: bench/gpu_check.sh sizes its passes so, and the unbatched ones finish). `--lm-targets` first
prints the issue's LM figures: one decode step at 16 rows vs 1 row, aggregate tokens/s at 16 rows
vs unbatched.

`--server N` then runs it once end to end: the real server (tiny CosyVoice 2 config) on 127.0.0.1
and N WebSocket clients on /v1/voice, each sending `say` with a reply at the same duty cycle and
playing the 200 ms frames as they come; first audio is from sending `say` (the whole reply text at
once) to the first frame, underruns are counted by the client's playback clock and by the server's
pacer (`audio.end` timings), and clients the server turns away (`busy`) are counted.

    python -m bench.serve --size tiny --seconds 5 --server 2      # seconds: the CI smoke run
    python -m bench.serve --size released --lm-targets --sessions 1,2 --seconds 60   # minutes
    python -m bench.serve --size released --device cuda --dtype float16 --sessions 64   # bench/gpu_check.sh

Released size means random weights (dense timing does not depend on them) through the engine's
`serve()`; the frontend and voice come from the tiny fixture model (tests/cosyvoice2/tiny_frontend.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)
from bench.cosyvoice2 import FIXTURES, released_hparams
from tests.conftest import make_settings, running_server
from voicebot.config.base import REPO_ROOT
from voicebot.config.engines import Cosyvoice2Config
from voicebot.tts.cosyvoice2.lm_pool import LMPool
from voicebot.tts.base import SAMPLE_RATE
from voicebot.tts.cosyvoice2.synthesizer import CosyVoice2Synthesizer
from voicebot.tts.cosyvoice2.flow import build_flow
from voicebot.tts.cosyvoice2.frontend import Frontend
from voicebot.tts.cosyvoice2.hift import build_hift
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, Step, build_lm
from voicebot.tts.cosyvoice2.loader import CosyVoice2Modules, cpu_weight_layout
from voicebot.tts.cosyvoice2.voices import VoiceLibrary

sys.path.insert(0, str(REPO_ROOT / "tests" / "cosyvoice2"))
from tiny_frontend import make_model_dir  # noqa: E402  (the fixture model's frontend stand-ins)

REPLIES = [
    "Sure, I can help with that. The stream starts at eight tonight.",
    "Thanks for the follow! Welcome to the channel, make yourself at home.",
    "That was a close one. Let's try the left path this time and see what happens.",
    "Good question. The patch notes say the boss has less health now, so it should be easier.",
    "Ha, no, I'm not a real person, but I do enjoy the chat a lot.",
    "We'll take a short break in five minutes. Grab some water and stretch.",
]
WORD_DELAY_S = 0.02  # a fast LLM: 50 words a second
REPLY_S = 4.5  # about how long a reply of REPLIES sounds (12 words at 160 a minute)


@dataclass
class Reply:
    first_audio_s: float  # first text delta to first audio
    audio_s: float
    wall_s: float  # first text delta to last audio
    underruns: int
    underrun_s: float


class Listener:
    """Plays a reply's audio in real time from its first piece on; counts where it ran out."""

    def __init__(self) -> None:
        self.began = time.monotonic()
        self.first: float | None = None
        self.playing_until = 0.0
        self.samples, self.underruns, self.underrun_s = 0, 0, 0.0

    def heard(self, samples: int) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first, self.playing_until = now - self.began, now
        elif now > self.playing_until:  # the listener ran out of audio before this piece came
            self.underruns += 1
            self.underrun_s += now - self.playing_until
            self.playing_until = now
        self.playing_until += samples / SAMPLE_RATE
        self.samples += samples

    def reply(self) -> Reply:
        return Reply(self.first or 0.0, self.samples / SAMPLE_RATE, time.monotonic() - self.began, self.underruns,
                     self.underrun_s)


async def speak(context, text: str) -> Reply:
    async def deltas():
        for i, word in enumerate(text.split(" ")):
            yield (" " if i else "") + word
            await asyncio.sleep(WORD_DELAY_S)

    listener = Listener()
    async for chunk in context.stream(deltas()):
        listener.heard(len(chunk.audio))
    return listener.reply()


@dataclass(frozen=True)
class Work:
    """How much each session of a pass speaks: `replies` replies (a bound by work: the pass takes
    as long as the device needs), or replies until `seconds` of wall time have passed (then the
    replies in flight finish). Either way the pass is cut at `timeout_s`, and what was cut counted."""

    seconds: float
    replies: int | None
    timeout_s: float

    def more(self, spoken: int, until: float) -> bool:
        return spoken < self.replies if self.replies is not None else time.monotonic() < until

    def start_spread_s(self, duty: float) -> float:
        """Sessions start at random within this: not all on one step. By wall time, early in the
        run; by work, over a reply's length stretched by the duty cycle, so that about `duty` of the
        sessions speak at once even when each speaks only one reply."""
        return min(2.0, self.seconds / 4) if self.replies is None else REPLY_S * (1 - duty) / duty


async def converse(rng: random.Random, duty: float, work: Work, until: float, replies: list[Reply], speak_one) -> None:
    """Replies at `duty`: speak one, stay quiet for a while, while `work` asks for more."""
    await asyncio.sleep(rng.uniform(0, work.start_spread_s(duty)))
    spoken = 0
    while work.more(spoken, until):
        reply = await speak_one(rng.choice(REPLIES))
        replies.append(reply)
        spoken += 1
        if work.more(spoken, until):
            await asyncio.sleep(reply.audio_s * (1 - duty) / duty * rng.uniform(0.5, 1.5))


async def session(synth: CosyVoice2Synthesizer, index: int, duty: float, work: Work, until: float,
                  replies: list[Reply]) -> None:
    context = synth.open()
    context.generator.manual_seed(index)
    try:
        await converse(random.Random(index), duty, work, until, replies, lambda text: speak(context, text))
    finally:
        await context.close()


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def run_all(tasks: list, timeout_s: float) -> int:
    """Run the sessions to their end, or cut them at timeout_s: the number of sessions cut (each
    loses the reply it was speaking and any it had still to speak)."""
    done, pending = await asyncio.wait([asyncio.ensure_future(t) for t in tasks], timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()
    return len(pending)


def summary(replies: list[Reply], wall: float) -> dict:
    firsts = [r.first_audio_s for r in replies]
    return {
        "replies": len(replies),
        "first p50": pct(firsts, 50), "first p95": pct(firsts, 95),
        "underruns": sum(r.underruns for r in replies), "underrun s": sum(r.underrun_s for r in replies),
        "RTF/stream": statistics.mean(r.wall_s / r.audio_s for r in replies if r.audio_s) if replies else float("nan"),
        "speech s/s": sum(r.audio_s for r in replies) / wall,
    }


def print_row(label: str, n: int, row: dict, tail: str) -> None:
    print(f"{label:10s} N={n:3d} " + " ".join(f"{k} {v:7.3f}" if isinstance(v, float) else f"{k} {v:4d}"
                                            for k, v in row.items()) + f"  {tail}", flush=True)


def histogram(after: Counter, before: Counter) -> str:
    return " ".join(f"{b}:{c - before.get(b, 0)}" for b, c in sorted(after.items()) if c > before.get(b, 0))


def run_sessions(synth: CosyVoice2Synthesizer, n: int, duty: float, work: Work, label: str) -> dict:
    scheduler = synth.scheduler
    batches_before, misses_before = Counter(scheduler.batch_sizes), scheduler.renders.deadline_misses
    renders_before = Counter(scheduler.renders.sizes)
    cuda = synth.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(synth.device)
    replies: list[Reply] = []
    began = time.monotonic()
    cut = asyncio.run(run_all([session(synth, i, duty, work, began + work.seconds, replies) for i in range(n)],
                              work.timeout_s))
    row = summary(replies, time.monotonic() - began) | {"misses": scheduler.renders.deadline_misses - misses_before,
                                                        "cut": cut}
    memory = f"  peak GPU memory {torch.cuda.max_memory_allocated(synth.device) / 2**30:.2f} GiB" if cuda else ""
    print_row(label, n, row, f"batches {histogram(scheduler.batch_sizes, batches_before)}"
                             f"  renders {histogram(scheduler.renders.sizes, renders_before)}{memory}")
    return row


# --- end to end: the server over WebSockets


async def say(ws, text: str) -> tuple[Reply, int]:
    """One `say` spoken: the client's view of it, and the underruns the server's pacer counted."""
    listener = Listener()
    await ws.send(json.dumps({"type": "say", "text": text}))
    while True:
        message = await asyncio.wait_for(ws.recv(), 120)
        if isinstance(message, bytes):
            listener.heard(len(message) // 2)
            continue
        event = json.loads(message)
        if event["type"] == "error":
            raise RuntimeError(f"the server answered an error: {event}")
        if event["type"] in ("audio.end", "audio.interrupted"):
            return listener.reply(), event.get("timings", {}).get("underruns", 0)


async def client(url: str, index: int, duty: float, work: Work, until: float, replies: list[Reply],
                 server_underruns: list[int], busy: list[dict]) -> None:
    import websockets

    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        while (event := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] != "session.ready":
            if event["type"] == "error":  # busy: the server is full (admission control)
                busy.append(event)
                return

        async def speak_one(text: str) -> Reply:
            reply, underruns = await say(ws, text)
            server_underruns.append(underruns)
            return reply

        await converse(random.Random(index), duty, work, until, replies, speak_one)


def run_server(root: Path, n: int, duty: float, work: Work, slots: int) -> dict:
    model_dir, voices = make_model_and_voice(root)
    settings = make_settings(server={"max_sessions": max(20, n + 1)}, tts={
        "engine": "cosyvoice2", "voice": "bench", "cosyvoice2": {
            "model": str(model_dir), "voices_dir": str(voices), "voice_cache_dir": str(root / "cache"), "device": "cpu",
            "batch_slots": slots, "kv_cache_tokens": 1024}})
    replies: list[Reply] = []
    server_underruns: list[int] = []
    busy: list[dict] = []
    with running_server(settings) as srv:
        scheduler = srv.runtime.synthesizer.scheduler
        batches_before, renders_before = Counter(scheduler.batch_sizes), Counter(scheduler.renders.sizes)
        began = time.monotonic()
        cut = asyncio.run(run_all([client(srv.ws_url, i, duty, work, began + work.seconds, replies, server_underruns,
                                          busy) for i in range(n)], work.timeout_s))
        row = summary(replies, time.monotonic() - began) | {"server underruns": sum(server_underruns),
                                                             "busy": len(busy), "cut": cut}
        print_row("server", n, row, f"batches {histogram(scheduler.batch_sizes, batches_before)}"
                                    f"  renders {histogram(scheduler.renders.sizes, renders_before)}")
    return row


# --- the LM targets


def _steps_at(x: torch.Tensor, start: int, n: int):
    for i in range(n):
        yield Step(x, start + i, ())


class DecodeTimer:
    """`rows` rows at a context of about `context` positions, stepped on demand."""

    def __init__(self, lm: CosyVoice2LM, rows: int, context: int = 200, steps: int = 64) -> None:
        self.pool = LMPool(lm, rows, context + steps + 8)
        w = lm.llm_decoder.weight
        x = torch.zeros(1, 1, w.shape[1], device=w.device, dtype=w.dtype)
        self.rows = [self.pool.open(lambda logp, history: 0) for _ in range(rows)]
        for row in self.rows:
            self.pool.start(row, _steps_at(x, context, steps))
        self.cuda = w.device.type == "cuda"
        self.step()  # warm-up (and on CUDA the graph capture)

    def step(self) -> tuple[float, float]:
        """Wall and process CPU seconds of one step."""
        began, began_cpu = time.perf_counter(), time.process_time()
        self.pool.decode(self.rows)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - began, time.process_time() - began_cpu


def print_lm_targets(lm: CosyVoice2LM, reps: int = 9) -> None:
    """1 row and 16 rows stepped alternately (ABAB: a shared machine's load drifts), medians. The
    CPU seconds beside: a loaded machine stalls the step's threads (wall) without them computing."""
    print(f"\nLM decode step, context 200, {reps} alternating steps each "
          f"(load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)", flush=True)
    timers = {1: DecodeTimer(lm, 1), 16: DecodeTimer(lm, 16)}
    times: dict[int, list[float]] = {1: [], 16: []}
    cpu: dict[int, list[float]] = {1: [], 16: []}
    for _ in range(reps):
        for rows, timer in timers.items():
            wall, cpu_s = timer.step()
            times[rows].append(wall)
            cpu[rows].append(cpu_s)
    one, sixteen = statistics.median(times[1]), statistics.median(times[16])
    one_cpu, sixteen_cpu = statistics.median(cpu[1]), statistics.median(cpu[16])
    print(f"  1 row:   {1000 * one:8.1f} ms (min {1000 * min(times[1]):.1f}; {1000 * one_cpu:.1f} ms cpu)", flush=True)
    print(f"  16 rows: {1000 * sixteen:8.1f} ms (min {1000 * min(times[16]):.1f}; {1000 * sixteen_cpu:.1f} ms cpu)"
          f"   = {sixteen / one:.2f}x one row's step ({sixteen_cpu / one_cpu:.2f}x cpu; target <= 3x)", flush=True)
    batched, unbatched = 16 / sixteen, 1 / one  # unbatched, 16 sessions still get one row per step
    print(f"  aggregate tokens/s at 16 sessions: batched {batched:.1f}, unbatched {unbatched:.1f}, "
          f"= {batched / unbatched:.2f}x (target >= 5x)", flush=True)


# --- the engine


def make_model_and_voice(root: Path) -> tuple[Path, Path]:
    """The tiny fixture model's directory and a voices directory with the voice `bench`, under root."""
    model_dir = make_model_dir(root / "model", FIXTURES)
    voices = root / "voices"
    voices.mkdir()
    t = np.arange(6 * 24000) / 24000  # 6 s: 150 prompt tokens, the baseline's prompt
    sf.write(voices / "bench.wav", (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 24000, subtype="FLOAT")
    (voices / "bench.txt").write_text("This is the voice of the stream, speaking clearly for the prompt.")
    return model_dir, voices


def build(size: str, device: str, dtype: str, root: Path, slots: int, flow_left_chunks: int = -1) -> CosyVoice2Synthesizer:
    model_dir, voices = make_model_and_voice(root)
    config = Cosyvoice2Config(model=str(model_dir), voices_dir=voices, voice_cache_dir=root / "cache", device=device,
                              dtype=dtype, batch_slots=slots, kv_cache_tokens=1024, flow_left_chunks=flow_left_chunks)
    synth = CosyVoice2Synthesizer(config, default_voice="bench")
    if size == "tiny":
        synth.load()  # the real loading path
        return synth
    hp = released_hparams(FIXTURES, root)
    dev, torch_dtype = synth.device, synth.dtype
    torch.manual_seed(0)
    lm, flow, hift = build_lm(hp).eval(), build_flow(hp["flow"]).eval(), build_hift(hp["hift"]).eval()
    lm, flow, hift = (cpu_weight_layout(m) for m in (lm.to(dev, torch_dtype), flow.to(dev, torch_dtype), hift.to(dev)))
    library = VoiceLibrary(Frontend.from_model_dir(model_dir, cuda=dev.type == "cuda"), config.voice_cache_dir)
    library.load_dir(voices)
    synth.serve(CosyVoice2Modules(model_dir, hp, lm, flow, hift, dev, torch_dtype), library)
    return synth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", "released"], default="tiny")
    parser.add_argument("--sessions", default="1,2,4,8,16,32", help="session counts to run ('' for none)")
    parser.add_argument("--duty", type=float, default=0.3, help="share of the time each session speaks")
    parser.add_argument("--seconds", type=float, default=20.0, help="wall seconds each N runs (replies then finish)")
    parser.add_argument("--replies", type=int, default=None,
                        help="instead of --seconds: replies each session speaks (a pass bounded by work)")
    parser.add_argument("--pass-timeout", type=float, default=None,
                        help="seconds after which a pass is cut, its cut sessions counted (default 4 x --seconds + 120)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lm-targets", action="store_true", help="print the LM decode targets first")
    parser.add_argument("--no-unbatched", action="store_true", help="skip the runs with batching off")
    parser.add_argument("--flow-left-chunks", type=int, default=-1,
                        help="the flow cache's window in chunks (-1: unbounded); >= 0 on CUDA: renders as CUDA graphs")
    parser.add_argument("--server", type=int, default=0, metavar="N",
                        help="then N WebSocket clients through the real server at tiny size (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(n) for n in args.sessions.split(",") if n]
    work = Work(args.seconds, args.replies, args.pass_timeout or args.seconds * 4 + 120)
    if not counts and not args.server:  # the LM figures alone: no flow, HiFT or voice to build
        with tempfile.TemporaryDirectory() as tmp:
            device = torch.device(args.device)
            dtype = torch.float32 if args.dtype == "auto" and device.type == "cpu" else getattr(torch, args.dtype, torch.float16)
            lm = build_lm(released_hparams(FIXTURES, Path(tmp)) if args.size == "released" else load_hparams(FIXTURES))
            print_lm_targets(cpu_weight_layout(lm.eval().to(device, dtype)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        synth = build(args.size, args.device, args.dtype, Path(tmp), slots=max([16, *counts]),
                      flow_left_chunks=args.flow_left_chunks)
        print(f"{args.size} engine on {synth.device}/{synth.dtype} in {time.perf_counter() - began:.1f} s, "
              f"{args.threads} threads; calibrated decode step s by batch: {synth.scheduler.costs.decode}", flush=True)
        t2w = synth.token2wav
        print(f"flow window {t2w.flow_left_chunks} chunks; renders "
              + (f"bucketed: {len(t2w.window_flow.graphs.captured)} flow and {len(t2w.hift_buckets.graphs.captured)} "
                 f"HiFT CUDA graphs, a flow state pool of {t2w.window_flow.slots.slots} slots "
                 f"({t2w.window_flow.slots.nbytes() / 2**30:.2f} GiB)" if t2w.window_flow
                 else "eager (bucketed shapes need CUDA, cuda_graphs and a window)"), flush=True)
        try:
            if args.lm_targets:
                print_lm_targets(synth.lm)
            if counts:
                amount = f"{args.replies} replies per session" if args.replies else f"{args.seconds:g} s per N"
                print(f"\n{args.duty:.0%} duty, {amount}, a pass cut at {work.timeout_s:g} s; first audio after the "
                      f"reply text arrives (s)", flush=True)
            results = {}
            for mode in ("batched", "unbatched"):
                if mode == "unbatched" and args.no_unbatched:
                    break
                synth.scheduler.max_batch = synth.scheduler.pool.slots if mode == "batched" else 1
                synth.scheduler.renders.max_batch = synth.config.render_batch if mode == "batched" else 1
                for n in counts:
                    results[mode, n] = run_sessions(synth, n, args.duty, work, mode)
            if counts and not args.no_unbatched:
                print("\nbatched / unbatched: speech s per wall s (higher is better), first audio p50 (lower is better)")
                for n in counts:
                    b, u = results["batched", n], results["unbatched", n]
                    ratio = b["speech s/s"] / u["speech s/s"] if u["speech s/s"] else float("inf")
                    cut = f"  (sessions cut: batched {b['cut']}, unbatched {u['cut']})" if b["cut"] or u["cut"] else ""
                    print(f"  N={n:3d}  throughput {ratio:5.2f}x   "
                          f"first audio p50 {b['first p50']:.3f} vs {u['first p50']:.3f} s{cut}", flush=True)
            print(f"\nadmission: capacity {synth.scheduler.capacity()} speaking sessions at the measured costs "
                  f"(render s per audio s {synth.scheduler.costs.render_per_audio_s})", flush=True)
        finally:
            synth.close()
        if args.server:
            print(f"\nend to end: the server (tiny CosyVoice 2, batched) and {args.server} WebSocket clients, "
                  f"first audio after `say` (s)", flush=True)
            (Path(tmp) / "server").mkdir()
            run_server(Path(tmp) / "server", args.server, args.duty, work, slots=max([16, *counts]))


if __name__ == "__main__":
    main()
