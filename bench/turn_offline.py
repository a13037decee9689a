"""Turn policies replayed offline: what Smart Turn says at every pause and every end of the test set.

    python bench/turn_offline.py [--hangover-ms 64] [--model-ms 70]

No server, no clock: the model is asked about each boundary of tests/turn_set.py (each pause
inside a turn, each true end) with the audio a session would give it, the turn so far from
`pre_speech_ms` before its speech (zero-padded at the front to 8 s, as pipecat does) plus the
silence heard when it asks, on a 32 ms grid of silences (the VAD's window). A policy (first
question after `pause` of VAD silence, again every `reask`, "complete" at `threshold`, the turn
over at `limit` anyway) is then replayed on those answers: a false cut-in is a pause where some
answer came back "complete" before the user went on; the latency of an end is when the first
"complete" came back (or the limit). The silence rule is the same replay with no model.

This separates what the model decides from what a loaded server adds (bench/latency.py measures
that), and tunes nothing on the set it reports: the policies are chosen on one half of the turns
(even-numbered in each group) and reported on both halves.

`--hangover-ms`: real silence before the VAD's silence begins (Silero's hangover and the chunk,
bench/latency.py's "end -> VAD speech end"); `--model-ms`: one call's answer time. The replay
gives the silence heard (from the true end) when the turn is decided; the reply's first frame
follows by bench/latency.py's "turn.end -> first frame".
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.turn_set import SAMPLE_RATE, TURNS, RenderedTurn, render_all  # noqa: E402
from voicebot.audio.turn import SmartTurn  # noqa: E402
from voicebot.config import EndpointConfig  # noqa: E402

WINDOW_MS = 32
# VAD silence when asked. Past 1 s no question is replayed (the set's pauses end by 0.9 s): an end
# still "incomplete" then waits for the limit, so a policy's slowest ends read a little late.
GRID_MS = list(range(WINDOW_MS, 1024 + WINDOW_MS, WINDOW_MS))
PRE_SPEECH_MS = EndpointConfig().pre_speech_ms


@dataclass(frozen=True)
class Boundary:
    turn: str
    half: int  # 0: tuning half, 1: the other
    language: str
    is_end: bool  # the true end of the turn; else a pause inside it
    length_ms: float  # the pause's length (inf for an end)
    p: dict[int, float]  # silence heard (ms, on GRID_MS) -> the model's probability of "complete"


def boundaries(rendered: list[RenderedTurn], model: SmartTurn, hangover_ms: int) -> list[Boundary]:
    halves, counts = {}, {}
    for r in rendered:
        group = (r.item.language, r.item.paused)
        halves[r.item.name] = counts.get(group, 0) % 2
        counts[group] = counts.get(group, 0) + 1
    questions = []  # (turn index, boundary start s, is_end, length_ms)
    for i, r in enumerate(rendered):
        for start, end in r.pauses:
            questions.append((i, start, False, (end - start) * 1000))
        questions.append((i, r.end_s, True, float("inf")))
    out = []
    for i, start, is_end, length_ms in questions:
        r = rendered[i]
        speech = np.concatenate([np.zeros(SAMPLE_RATE * PRE_SPEECH_MS // 1000, np.float32), r.audio[: int(start * SAMPLE_RATE)]])
        # The silence a policy can ask at: the pause itself, less the window that would hear speech again.
        grid = [ms for ms in GRID_MS if ms + hangover_ms < length_ms - WINDOW_MS]
        windows = [np.concatenate([speech, np.zeros(SAMPLE_RATE * (ms + hangover_ms) // 1000, np.float32)]) for ms in grid]
        probabilities = np.concatenate([model.predict(windows[j : j + 16]) for j in range(0, len(windows), 16)]) if windows else []
        out.append(Boundary(r.item.name, halves[r.item.name], r.item.language, is_end, length_ms, dict(zip(grid, map(float, probabilities)))))
    return out


@dataclass(frozen=True)
class Policy:
    name: str
    pause_ms: int | None  # None: the silence rule
    reask_ms: int = 320
    threshold: float = 0.5
    limit_ms: int = 1500

    def decide(self, b: Boundary, hangover_ms: int, model_ms: int) -> float | None:
        """Real silence (ms) when the turn is ended at this boundary; None if the user went on first."""
        limit = (self.limit_ms if self.pause_ms is not None else 500) + hangover_ms
        if self.pause_ms is not None:
            ask = self.pause_ms
            while ask + hangover_ms < min(limit, b.length_ms):
                at = _on_grid(ask)
                if at not in b.p:
                    break
                answered = ask + hangover_ms + model_ms
                if b.p[at] >= self.threshold and answered < b.length_ms:
                    return min(answered, limit)
                # One question at a time: the next at the first step of the schedule after its answer.
                following = ask + self.reask_ms
                while following <= ask + model_ms:
                    following += self.reask_ms
                ask = following
        return limit if limit < b.length_ms else None


def _on_grid(ms: int) -> int:
    return max(WINDOW_MS, int(np.ceil(ms / WINDOW_MS)) * WINDOW_MS)


def report(policy: Policy, bs: list[Boundary], hangover_ms: int, model_ms: int) -> str:
    turns = {b.turn for b in bs}
    cut = {b.turn for b in bs if not b.is_end and policy.decide(b, hangover_ms, model_ms) is not None}
    ends = [policy.decide(b, hangover_ms, model_ms) for b in bs if b.is_end]
    latency = np.array(ends, float)
    return (f"cut-ins {len(cut):>2}/{len(turns):<3} ({100 * len(cut) / len(turns):>3.0f}%)  "
            f"decided p50 {np.percentile(latency, 50):>5.0f} p95 {np.percentile(latency, 95):>5.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hangover-ms", type=int, default=64)
    parser.add_argument("--model-ms", type=int, default=70)
    args = parser.parse_args()

    rendered = render_all(TURNS)
    model = SmartTurn()
    t0 = time.monotonic()
    bs = boundaries(rendered, model, args.hangover_ms)
    model.close()
    print(f"{len(bs)} boundaries asked at {len(GRID_MS)} silences in {time.monotonic() - t0:.0f} s; "
          f"hangover {args.hangover_ms} ms, model {args.model_ms} ms")

    print("\nthe model's answers: share judged complete, by the silence heard (the VAD's; the real one is hangover more)")
    print(f"{'':>12} " + " ".join(f"{ms:>5}" for ms in (96, 160, 224, 288, 352, 480, 640, 800)))
    for language, is_end in itertools.product(("en", "zh"), (False, True)):
        row = [b for b in bs if b.language == language and b.is_end == is_end]
        cells = []
        for ms in (96, 160, 224, 288, 352, 480, 640, 800):
            asked = [b.p[ms] >= 0.5 for b in row if ms in b.p]
            cells.append(f"{100 * np.mean(asked):>4.0f}%" if asked else f"{'-':>5}")
        print(f"{language + (' end' if is_end else ' pause'):>12} " + " ".join(cells) + f"   (n={len(row)})")

    default = EndpointConfig()
    candidates = [Policy("silence 500", None),
                  Policy(f"smart {default.smart_pause_ms}/{default.smart_reask_ms} @{default.smart_threshold}",
                         default.smart_pause_ms, default.smart_reask_ms, default.smart_threshold)]
    candidates += [Policy(f"smart {p}/{r} @{t}", p, r, t)
                   for p, r, t in itertools.product((160, 224, 288), (96, 160, 320), (0.5, 0.7, 0.85))]
    tuning = [b for b in bs if b.half == 0]
    silence_cut = sum(1 for b in tuning if not b.is_end and candidates[0].decide(b, args.hangover_ms, args.model_ms) is not None)

    def score(policy: Policy) -> tuple:
        cut = sum(1 for b in tuning if not b.is_end and policy.decide(b, args.hangover_ms, args.model_ms) is not None)
        ends = [policy.decide(b, args.hangover_ms, args.model_ms) for b in tuning if b.is_end]
        return (cut > silence_cut, float(np.percentile(ends, 50)) + float(np.percentile(ends, 95)))

    best = min(candidates[2:], key=score)
    print(f"\npolicies (tuned on half 0: the fastest with no more cut-ins than silence there: {best.name})")
    for policy in [candidates[0], candidates[1], best]:
        for half in (0, 1):
            print(f"{policy.name:>22} half {half}: {report(policy, [b for b in bs if b.half == half], args.hangover_ms, args.model_ms)}")


if __name__ == "__main__":
    main()
