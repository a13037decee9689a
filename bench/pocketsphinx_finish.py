"""pocketsphinx's end of utterance: what the searches run after the user stops cost, and what they buy.

    python bench/pocketsphinx_finish.py [--model grammar|lm]

Decodes tests/turn_set.py's turns (grammar: all 80 against bench/latency.py's grammar; lm: the 52
English ones with the general English LM) in 40 ms chunks, with a partial hypothesis after each
(as the server does), and times end_utt + hyp() (the recognizer's finish: it runs after the
endpoint, before the transcript is in) for each decoder setting, side by side in one run: CPU time
(the box may be shared) and wall time, and the word match (difflib ratio against the text spoken).
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
from voicebot.asr.pocketsphinx import PocketsphinxRecognizer  # noqa: E402

CHUNK_BYTES = 640 * 2  # 40 ms of 16 kHz s16le


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def decode(decoder, pcm: bytes) -> tuple[str, float, float]:
    """The transcript, and the finish's CPU and wall seconds."""
    decoder.start_utt()
    for i in range(0, len(pcm), CHUNK_BYTES):
        decoder.process_raw(pcm[i : i + CHUNK_BYTES], False, False)
        decoder.hyp()
    wall, cpu = time.perf_counter(), time.thread_time()
    decoder.end_utt()
    hyp = decoder.hyp()
    return (hyp.hypstr if hyp else ""), time.thread_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["grammar", "lm"], default="grammar")
    args = parser.parse_args()
    from pocketsphinx import Decoder

    rendered = render_all(TURNS)
    turns = rendered if args.model == "grammar" else [t for t in rendered if t.item.language == "en"]
    jsgf = PocketsphinxRecognizer._jsgf(grammar(rendered))
    settings = {"bestpath": [dict(bestpath=True), dict(bestpath=False)]}
    if args.model == "lm":
        settings = {"bestpath, fwdflat": [dict(bestpath=b, fwdflat=f) for f in (True, False) for b in (True, False)]}
    print(f"{args.model}: {len(turns)} turns, finish = end_utt + hyp(), ms")
    for options in next(iter(settings.values())):
        decoder = Decoder(samprate=16000, loglevel="FATAL", **options, **({"lm": None} if args.model == "grammar" else {}))
        if args.model == "grammar":
            decoder.add_jsgf_string("phrases", jsgf)
            decoder.activate_search("phrases")
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
