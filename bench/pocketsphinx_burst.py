"""pocketsphinx on the server's threads against decoding processes, side by side in one run.

    python bench/pocketsphinx_burst.py [--model lm|grammar] [--streams 16] [--rounds 1] [--throughput-s 5]
    python bench/pocketsphinx_burst.py --model grammar --streams 16 --joining 8 [--rounds 2]

Three recognizers built as the server builds them (voicebot/asr/pocketsphinx.py), alive together:
`processes: 0` (two worker threads in this process, the GIL shared with the event loop), 1 process
and 2 processes; the default `decoders` pool (as many as fit in 480 MB: 4-5 with the general LM,
16-17 with a grammar). Measured on one event loop, the modes taking turns round by round so that
the box's other load falls on all alike:

- burst: `--streams` streams open at once and each feeds espeak speech (tests/audio.py) in 40 ms
  chunks at real time, as sessions do, then finishes. A heartbeat on the loop (5 ms sleeps) gives
  the loop's lag: p99 and worst, and the ticks over 100 ms (what voicebot/loop_watch.py counts as
  stalls). More streams than the pool build decoders (0.3-0.6 s of CPU each): on the threads, with
  the GIL held.
- throughput: 4 streams each feed `--throughput-s` of speech as fast as the recognizer answers:
  seconds of audio decoded per wall second, and the decoding's CPU seconds per second of audio.
- round trip: one stream, a one-sample chunk at a time (next to no decoding): what a call costs beyond the
  decoding (the worker hop on the threads; that plus the pipe, both ways, on a process).

Ratios are against the threads. The box may be shared: compare within one run, not across runs.

`--joining N` measures instead what a burst of connects does to the streams already speaking, on 2
processes with the default pool (or `--decoders`): `--streams` streams speak (two utterances back to back, 40 ms
chunks at real time); 1 s in, N more open 50 ms apart (as bench/live_speakers.py's clients connect)
and speak one utterance, each unless the recognizer says it is full (`full`, which admission asks:
a joiner would need a decoder built in a child its streams speak on). Printed: the joiners refused
per round, the speaking streams' feeds (the time each chunk's accept took, the answer included)
before the joins and from the first join on, p50 / p99 / worst and how many took over 250 ms
(limits.max_input_lag_s), and how many decoders the children built after start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.audio import espeak_speech  # noqa: E402
from tests.conftest import TEST_PHRASES  # noqa: E402
from voicebot.asr.pocketsphinx import PocketsphinxRecognizer  # noqa: E402
from voicebot.config.engines import PocketsphinxConfig  # noqa: E402
from voicebot.memory import freeze_startup_heap  # noqa: E402

CHUNK = 640  # 40 ms at 16 kHz, as the server feeds it
BEAT_S = 0.005
STALL_S = 0.1
LATE_S = 0.25  # limits.max_input_lag_s: a chunk later than this is a deadline miss
SENTENCES = [
    "hello there how are you doing today",
    "what is the weather like in the city this evening",
    "can you tell me a story about a dragon and a knight",
    "i would like to know more about the game we played yesterday",
]
MODES = {"threads": 0, "1 process": 1, "2 processes": 2}


class LoopLag:
    """The event loop's lateness, sampled by a task that sleeps BEAT_S at a time."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    async def _beat(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(BEAT_S)
            self.lags.append(time.perf_counter() - start - BEAT_S)

    def __enter__(self) -> "LoopLag":
        self._task = asyncio.get_running_loop().create_task(self._beat())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


async def speak(engine: PocketsphinxRecognizer, audio: np.ndarray, finishes: list[float],
                feeds: list[tuple[float, float]] | None = None) -> str:
    """One stream: the audio at real time, then the finish (its wall time recorded); each feed's
    (start, time taken) into `feeds` if given."""
    stream = engine.open()
    try:
        start = time.perf_counter()
        for index, at in enumerate(range(0, len(audio), CHUNK)):
            fed = time.perf_counter()
            await stream.accept(audio[at : at + CHUNK])
            if feeds is not None:
                feeds.append((fed, time.perf_counter() - fed))
            delay = start + (index + 1) * CHUNK / 16000 - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        began = time.perf_counter()
        text = (await stream.finish()).text
        finishes.append(time.perf_counter() - began)
        return text
    finally:
        await stream.close()


async def burst(engine: PocketsphinxRecognizer, utterances: list[np.ndarray], streams: int) -> tuple[list[float], list[float]]:
    finishes: list[float] = []
    with LoopLag() as lag:
        await asyncio.gather(*(speak(engine, utterances[i % len(utterances)], finishes) for i in range(streams)))
    return lag.lags, finishes


async def joining(engine: PocketsphinxRecognizer, utterances: list[np.ndarray], speaking: int,
                  joiners: int) -> tuple[list[float], list[float], int]:
    """The speaking streams' feed times before the first join and from it on (see the module doc),
    and how many joiners the recognizer refused (`full`: a build would hold a child streams speak on)."""
    feeds: list[tuple[float, float]] = []
    long_utterances = [np.concatenate([u, utterances[(i + 1) % len(utterances)]]) for i, u in enumerate(utterances)]
    speakers = [asyncio.create_task(speak(engine, long_utterances[i % len(utterances)], [], feeds))
                for i in range(speaking)]
    await asyncio.sleep(1.0)
    first_join = time.perf_counter()
    joins, refused = [], 0
    for i in range(joiners):
        if engine.full() is None:  # as the server's admission asks it
            joins.append(asyncio.create_task(speak(engine, utterances[i % len(utterances)], [])))
        else:
            refused += 1
        await asyncio.sleep(0.05)
    await asyncio.gather(*speakers, *joins)
    return [took for at, took in feeds if at < first_join], [took for at, took in feeds if at >= first_join], refused


async def run_joining(args: argparse.Namespace, phrases: list[str], utterances: list[np.ndarray]) -> None:
    engine = PocketsphinxRecognizer(PocketsphinxConfig(phrases=phrases, processes=2, decoders=args.decoders))
    await asyncio.to_thread(engine.load)
    freeze_startup_heap()
    pool = sum(process.keep for process in engine.processes)
    try:
        await speak(engine, utterances[0], [])  # the cepstral means warm
        built = sum(process.built for process in engine.processes)
        before, after, refused = [], [], []
        for _ in range(args.rounds):
            round_before, round_after, round_refused = await joining(engine, utterances, args.streams, args.joining)
            before += round_before
            after += round_after
            refused.append(round_refused)
        built = sum(process.built for process in engine.processes) - built
        print(f"\nmodel {args.model}, 2 processes, a pool of {pool}: {args.streams} streams speaking, "
              f"{args.joining} joining, {args.rounds} rounds; joiners refused per round {refused}; "
              f"{built} decoders built after start-up")
        for name, times in (("before the joins", before), ("from the first join", after)):
            late = sum(took > LATE_S for took in times)
            print(f"  {name:20} {len(times):5d} feeds  p50 {ms(times, 50):6.1f}  p99 {ms(times, 99):7.1f}  "
                  f"worst {max(times) * 1000:7.1f} ms  over {LATE_S * 1000:.0f} ms {late:4d}")
    finally:
        engine.close()


def busy_s(engine: PocketsphinxRecognizer) -> float:
    """CPU seconds the engine's decoding took so far: its worker threads', or its children's."""
    return sum(pool.busy_s for pool in engine.workers())


async def throughput(engine: PocketsphinxRecognizer, audio: np.ndarray, streams: int = 4) -> tuple[float, float]:
    """Seconds of audio decoded per wall second, and CPU seconds per second of audio."""
    async def feed() -> None:
        stream = engine.open()
        try:
            for at in range(0, len(audio), CHUNK):
                await stream.accept(audio[at : at + CHUNK])
            await stream.finish()
        finally:
            await stream.close()

    start, cpu = time.perf_counter(), busy_s(engine)
    await asyncio.gather(*(feed() for _ in range(streams)))
    seconds = streams * len(audio) / 16000
    return seconds / (time.perf_counter() - start), (busy_s(engine) - cpu) / seconds


async def round_trips(engine: PocketsphinxRecognizer, count: int = 500) -> list[float]:
    stream = engine.open()
    tiny = np.zeros(1, np.float32)  # one sample: next to no decoding
    try:
        await stream.accept(tiny)  # the open (a borrow) out of the way
        times = []
        for _ in range(count):
            start = time.perf_counter()
            await stream.accept(tiny)
            times.append(time.perf_counter() - start)
        await stream.finish()
        return times
    finally:
        await stream.close()


def ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000


async def run(args: argparse.Namespace) -> None:
    phrases = [] if args.model == "lm" else SENTENCES + TEST_PHRASES
    silence = np.zeros(4800, np.float32)
    utterances = [np.concatenate([silence, espeak_speech(s), silence, silence]) for s in SENTENCES]
    if args.joining:
        await run_joining(args, phrases, utterances)
        return
    long_audio = np.concatenate(utterances * 3)[: 16000 * args.throughput_s]
    engines = {}
    for name, processes in MODES.items():
        started = time.perf_counter()
        engines[name] = PocketsphinxRecognizer(PocketsphinxConfig(phrases=phrases, processes=processes))
        await asyncio.to_thread(engines[name].load)
        print(f"{name}: loaded in {time.perf_counter() - started:.1f} s")
    freeze_startup_heap()  # as the server does after start-up: no full collection walks the engines
    try:
        for name, engine in engines.items():  # one utterance each: the cepstral means warm
            await speak(engine, utterances[0], [])
        lags = {name: [] for name in engines}
        finishes = {name: [] for name in engines}
        rates = {name: [] for name in engines}
        cpu = {name: [] for name in engines}
        trips = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                round_lags, round_finishes = await burst(engine, utterances, args.streams)
                lags[name] += round_lags
                finishes[name] += round_finishes
            for name, engine in engines.items():
                rate, cpu_per_s = await throughput(engine, long_audio)
                rates[name].append(rate)
                cpu[name].append(cpu_per_s)
            for name, engine in engines.items():
                trips[name] += await round_trips(engine)
        print(f"\nmodel {args.model}, {args.streams} streams at once at real time, {args.rounds} rounds; "
              f"ratios against the threads")
        base = "threads"
        for name in engines:
            stalls = sum(lag > STALL_S for lag in lags[name])
            print(f"  {name:12} loop lag p99 {ms(lags[name], 99):7.1f} ms ({ms(lags[name], 99) / ms(lags[base], 99):5.2f}x)"
                  f"  worst {max(lags[name]) * 1000:7.1f} ms ({max(lags[name]) / max(lags[base]):5.2f}x)"
                  f"  ticks over 100 ms {stalls:3d}"
                  f"  finish p50 {ms(finishes[name], 50):6.1f} p95 {ms(finishes[name], 95):6.1f} ms")
        print(f"throughput, 4 streams of {args.throughput_s} s as fast as answered: s of audio per wall s; "
              f"decoding CPU s per s of audio")
        for name in engines:
            rate = np.median(rates[name])
            print(f"  {name:12} {rate:6.2f} ({rate / np.median(rates[base]):5.2f}x)  rounds {' '.join(f'{r:.2f}' for r in rates[name])}"
                  f"  CPU {np.median(cpu[name]):.3f} s per s, so {rate * np.median(cpu[name]):.2f} cores busy decoding")
        print("round trip of a one-sample chunk (next to no decoding)")
        for name in engines:
            print(f"  {name:12} p50 {ms(trips[name], 50) * 1000:6.0f} us  p99 {ms(trips[name], 99) * 1000:7.0f} us"
                  f"  ({ms(trips[name], 50) / ms(trips[base], 50):5.2f}x)")
    finally:
        for engine in engines.values():
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["grammar", "lm"], default="lm", help="lm: the default config's")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--joining", type=int, default=0,
                        help="streams opening while --streams speak (the module doc): only that is measured")
    parser.add_argument("--decoders", type=int, help="with --joining: the pool, not the default")
    parser.add_argument("--throughput-s", type=int, default=5, help="seconds of speech per throughput stream")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
