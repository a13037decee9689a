"""What FunASR's punctuation model (asr.paraformer.punc_model, voicebot/asr/punctuation.py) costs a
final: ms of one call on texts of a segment's lengths, at the released ct-punc-c shape with random
weights (272,727-token vocabulary, 256 wide, 4 SAN-M blocks, 291 MB of model.pt: the real model's
compute, nonsense marks), built into a temporary directory and loaded by the server's own loader.

    OMP_NUM_THREADS=1 python bench/punctuation.py [--size ct-punc-c|tiny] [--rounds 50]

The texts are the turn set's Mandarin parts and sentences (tests/turn_set.py) unpunctuated, and
longer ones made by joining them. Wall time of each call on the calling thread, so on a shared
machine an upper bound.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.asr.tiny_punctuation import build_punctuation_dir  # noqa: E402
from tests.turn_set import COMPLETE_ZH, PAUSED_ZH  # noqa: E402
from voicebot.asr.punctuation import Punctuator  # noqa: E402
from voicebot.audio.turn_words import unpunctuated  # noqa: E402


def texts_by_length() -> dict[str, list[str]]:
    parts = [unpunctuated(p).replace(" ", "") for item in PAUSED_ZH for p in item]
    sentences = [unpunctuated(s).replace(" ", "") for s in COMPLETE_ZH]
    joined = ["".join(sentences[i:i + 4]) for i in range(0, len(sentences) - 3, 2)]
    return {"a part (2-9 chars)": parts, "a sentence (4-12)": sentences, "four sentences (30-40)": joined}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("ct-punc-c", "tiny"), default="ct-punc-c")
    parser.add_argument("--rounds", type=int, default=50, help="calls per length class")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        path = build_punctuation_dir(Path(root) / args.size, size=args.size)
        built = time.perf_counter() - started
        size_mb = (path / "model.pt").stat().st_size / 1e6
        punctuator = Punctuator("asr.paraformer.punc_model", path)
        started = time.perf_counter()
        punctuator.load()
        loaded = time.perf_counter() - started
        print(f"{args.size}: model.pt {size_mb:.0f} MB, built in {built:.1f} s, loaded in {loaded:.1f} s, "
              f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
        for name, texts in texts_by_length().items():
            punctuator.punctuate_blocking(texts[0])  # warm-up
            times = []
            for k in range(args.rounds):
                text = texts[k % len(texts)]
                started = time.perf_counter()
                punctuator.punctuate_blocking(text)
                times.append((time.perf_counter() - started) * 1000)
            times.sort()
            p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
            print(f"  {name:<24} {len(texts):>3} texts  p50 {statistics.median(times):6.1f} ms  p95 {p95:6.1f} ms")
        punctuator.close()


if __name__ == "__main__":
    main()
