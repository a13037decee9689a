"""What one live speaker's input costs in the per-session stages that bench/live_speakers.py's input
figure leaves out or lumps together: the noise gate (µs of CPU per second of audio, fed 20 ms at a
time as a live microphone sends it) and Smart Turn's question (features and model, ms of CPU per
question, in calls of 1, 2, 4 and 8 questions, and as this code's SmartTurn batches 8 waiting), on the turn set's complete English turns (espeak) with the
silences between them a live client sends.

    python bench/per_speaker_cost.py [--seconds 60] [--rounds 20]

Run it with PYTHONPATH at another checkout to measure that code the same way (the before of a
change). CPU time of the whole process (every thread: torch's and onnxruntime's included), so on a
shared machine an upper bound; set OMP_NUM_THREADS=1 to price one core's work.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.turn_set import TURNS, render  # noqa: E402
from voicebot.audio.gate import NoiseGate  # noqa: E402
from voicebot.audio.turn import SmartTurn  # noqa: E402
from voicebot.config.stages import GateConfig  # noqa: E402

RATE = 16000
CHUNK = RATE // 50  # 20 ms
GAP_S = 0.5  # silence after each turn, as bench/live_speakers.py's clients leave


def speaker(seconds: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """`seconds` of turns and gaps, and the turns alone (what Smart Turn is asked about)."""
    turns = [render(item).audio for item in TURNS[:8]]
    pieces, total, k = [], 0, 0
    while total < seconds * RATE:
        turn = turns[k % len(turns)]
        pieces += [turn, np.zeros(int(GAP_S * RATE), np.float32)]
        total += len(turn) + int(GAP_S * RATE)
        k += 1
    return np.concatenate(pieces)[: int(seconds * RATE)], turns


def gate_us_per_audio_s(audio: np.ndarray) -> float:
    gate = NoiseGate(GateConfig(), RATE)
    start = time.process_time()
    for i in range(0, len(audio), CHUNK):
        gate.process(audio[i : i + CHUNK])
    return (time.process_time() - start) / (len(audio) / RATE) * 1e6


def question_ms(smart: SmartTurn, turns: list[np.ndarray], waiting: int, batch: int, rounds: int) -> float:
    """Median CPU ms per question of `predict` (features and model) for `waiting` questions answered
    in calls of at most `batch`, as SmartTurn's drain makes them."""
    costs = []
    smart.predict(turns[:batch])  # warm: onnxruntime's first run plans its graph
    for r in range(rounds):
        questions = [turns[(r + i) % len(turns)] for i in range(waiting)]
        start = time.process_time()
        for k in range(0, waiting, batch):
            smart.predict(questions[k : k + batch])
        costs.append((time.process_time() - start) / waiting * 1000)
    return float(np.median(costs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    audio, turns = speaker(args.seconds)
    print(f"noise gate: {gate_us_per_audio_s(audio):.0f} µs CPU per s of audio ({args.seconds:g} s, 20 ms chunks)")
    smart = SmartTurn()
    try:
        for batch in (1, 2, 4, 8):
            print(f"Smart Turn: {question_ms(smart, turns, 8, batch, args.rounds):.1f} ms CPU per question in calls of {batch} "
                  f"(features and model; median of {args.rounds})")
        print(f"Smart Turn as this code answers 8 waiting questions (calls of at most {smart.max_batch}): "
              f"{question_ms(smart, turns, 8, smart.max_batch, args.rounds):.1f} ms CPU per question")
    finally:
        smart.close()


if __name__ == "__main__":
    main()
