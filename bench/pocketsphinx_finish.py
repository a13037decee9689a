"""pocketsphinx's end of utterance: what the searches run after the user stops cost, and what they buy.

    python bench/pocketsphinx_finish.py [--model grammar|lm] [--partials]

Decodes tests/turn_set.py's turns (grammar: all 80 against bench/latency.py's grammar; lm: the 52
English ones with the general English LM) in 40 ms chunks, with a partial hypothesis after each
(as the server does), and times end_utt + hyp() (the recognizer's finish: it runs after the
endpoint, before the transcript is in) for each decoder setting, side by side in one run: CPU time
(the box may be shared) and wall time, and the word match (difflib ratio against the text spoken).

--partials instead times the feeding (process_raw + the partial hyp()) per second of audio, a
partial after every chunk against one every PARTIAL_INTERVAL_SAMPLES (as the server does now),
alternating turn by turn in one run, and checks the finals are the same.
"""

from __future__ import annotations

import argparse
import difflib
import re
import time

import numpy as np

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from bench.latency import grammar  # noqa: E402
from tests.turn_set import TURNS, render_all  # noqa: E402
from voicebot.asr.pocketsphinx_decoders import PARTIAL_INTERVAL_SAMPLES, jsgf as to_jsgf  # noqa: E402

CHUNK_BYTES = 640 * 2  # 40 ms of 16 kHz s16le


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def feed(decoder, pcm: bytes, partial_every: int) -> float:
    """Feeds an utterance in chunks, a partial hyp() every `partial_every` bytes; its CPU seconds."""
    cpu, since_partial = time.thread_time(), 0
    decoder.start_utt()
    for i in range(0, len(pcm), CHUNK_BYTES):
        decoder.process_raw(pcm[i : i + CHUNK_BYTES], False, False)
        since_partial += CHUNK_BYTES
        if since_partial >= partial_every:
            since_partial = 0
            decoder.hyp()
    return time.thread_time() - cpu


def decode(decoder, pcm: bytes, partial_every: int = CHUNK_BYTES) -> tuple[str, float, float]:
    """The transcript, and the finish's CPU and wall seconds."""
    feed(decoder, pcm, partial_every)
    wall, cpu = time.perf_counter(), time.thread_time()
    decoder.end_utt()
    hyp = decoder.hyp()
    return (hyp.hypstr if hyp else ""), time.thread_time() - cpu, time.perf_counter() - wall


def partials(make_decoder, turns) -> None:
    """The feeding's CPU per second of audio, a partial per chunk against the server's interval."""
    intervals = {"every 40 ms chunk": CHUNK_BYTES, f"every {PARTIAL_INTERVAL_SAMPLES // 16} ms": PARTIAL_INTERVAL_SAMPLES * 2}
    # A decoder each: its cepstral mean follows the audio it has decoded, the same for both.
    decoders = {name: make_decoder() for name in intervals}
    cpu = {name: [] for name in intervals}
    finals = {name: [] for name in intervals}
    for turn in turns:
        pcm = (np.clip(turn.audio, -1, 1) * 32767).astype("<i2").tobytes()
        seconds = len(turn.audio) / 16000
        for name, every in intervals.items():  # alternating, so the box's load falls on both alike
            start = time.thread_time()
            text, _, _ = decode(decoders[name], pcm, every)
            cpu[name].append((time.thread_time() - start) * 1000 / seconds)
            finals[name].append(text)
    for name in intervals:
        ms = cpu[name]
        print(f"  partial {name}: CPU ms per s of audio p50 {np.median(ms):5.1f} p95 {np.percentile(ms, 95):5.1f} "
              f"mean {np.mean(ms):5.1f}")
    base, throttled = (np.mean(cpu[name]) for name in intervals)
    same = sum(a == b for a, b in zip(*finals.values()))
    print(f"  saved {base - throttled:.1f} ms of CPU per s of audio ({1 - throttled / base:.0%}); "
          f"finals the same in {same}/{len(turns)} turns")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["grammar", "lm"], default="grammar")
    parser.add_argument("--partials", action="store_true", help="time the partials' throttle instead of the finish")
    args = parser.parse_args()
    from pocketsphinx import Decoder

    rendered = render_all(TURNS)
    turns = rendered if args.model == "grammar" else [t for t in rendered if t.item.language == "en"]
    jsgf = to_jsgf(grammar(rendered))
    settings = {"bestpath": [dict(bestpath=True), dict(bestpath=False)]}
    if args.model == "lm":
        settings = {"bestpath, fwdflat": [dict(bestpath=b, fwdflat=f) for f in (True, False) for b in (True, False)]}
    if args.partials:
        settings = {"server's": [dict(bestpath=False) if args.model == "grammar" else dict(bestpath=True, fwdflat=False)]}
        print(f"{args.model}: {len(turns)} turns, decoded twice each, the CPU of process_raw + partials + finish")
    else:
        print(f"{args.model}: {len(turns)} turns, finish = end_utt + hyp(), ms")
    for options in next(iter(settings.values())):
        def make_decoder():
            decoder = Decoder(samprate=16000, loglevel="FATAL", **options, **({"lm": None} if args.model == "grammar" else {}))
            if args.model == "grammar":
                decoder.add_jsgf_string("phrases", jsgf)
                decoder.activate_search("phrases")
            return decoder

        if args.partials:
            partials(make_decoder, turns)
            continue
        decoder = make_decoder()
        cpu, wall, match = [], [], []
        for turn in turns:
            pcm = (np.clip(turn.audio, -1, 1) * 32767).astype("<i2").tobytes()
            text, cpu_s, wall_s = decode(decoder, pcm)
            cpu.append(cpu_s * 1000)
            wall.append(wall_s * 1000)
            match.append(difflib.SequenceMatcher(None, words(" ".join(turn.item.parts)), words(text)).ratio())
        print(f"  {options}: CPU p50 {np.median(cpu):6.1f} p95 {np.percentile(cpu, 95):6.1f} max {max(cpu):6.1f}; "
              f"wall p50 {np.median(wall):6.1f} p95 {np.percentile(wall, 95):6.1f} max {max(wall):6.1f}; "
              f"word match {np.mean(match):.3f}")


if __name__ == "__main__":
    main()
