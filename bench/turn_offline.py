"""Turn policies replayed offline: what Smart Turn says at every pause and every end of the test set.

    python bench/turn_offline.py [--hangover-ms MS] [--model-ms 70] [--voice espeak|piper]

No server, no clock: the model is asked about each boundary of tests/turn_set.py (each pause
inside a turn, each true end) with the audio a session would give it, the turn so far from
`pre_speech_ms` before its speech (zero-padded at the front to 8 s, as pipecat does) plus the
silence heard when it asks, on a 32 ms grid of silences (the VAD's window). A policy (first
question after `pause` of VAD silence, again every `reask`, "complete" at `threshold`, the turn
over at `limit` anyway) is then replayed on those answers: a false cut-in is a pause where some
answer came back "complete" before the user went on; the latency of an end is when the first
"complete" came back (or the limit). The silence rule is the same replay with no model.

The model's answers are kept on disk (the temp dir's voicebot-turn-set/smart-turn/, keyed by the
audio, the hangover and the model file): a set is some thousands of calls, minutes of a core.
`--voice`: tests/turn_set.py's voice and its set (piper: English, natural prosody).

This separates what the model decides from what a loaded server adds (bench/latency.py measures
that), and tunes nothing on the set it reports: the policies are chosen on one half of the turns
(even-numbered in each group) and reported on both halves.

`--hangover-ms`: real silence before the VAD's silence begins (Silero's hangover and the chunk,
bench/latency.py's "end -> VAD speech end"; by default the endpointer's measured median below plus
half a 40 ms chunk); `--model-ms`: one call's answer time. The replay gives the silence heard (from
the true end) when the turn is decided; the reply's first frame follows by bench/latency.py's
"turn.end -> first frame".

First, the endpointer itself on the set (voicebot/audio/endpoint.py, Silero's own probabilities),
with and without its hangover cut (the quiet speech windows before a silence counted as silence),
in digital silence and in white room noise: where it says speech ended, after the true end, and
its segment ends that fall where the set has no pause, at the smart pause and at the silence
rule's length. Such an end is "in a gap" when the speech there really is silent for the pause's
length (espeak-ng's comma pauses; an end just as a set pause is over), else "mid-word".
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.turn_set import SAMPLE_RATE, VOICES, RenderedTurn, render_all, turn_set  # noqa: E402
from voicebot.audio import endpoint  # noqa: E402
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


NOISE_DBFS = (None, -60, -50)  # None: digital silence between the words
SILENT = 0.005  # what tests/turn_set.py trims as espeak-ng's near-silence
LEAD_S = 0.4


@dataclass
class EndpointerRun:
    lags_ms: list[float]  # reported speech end after the true end, at each end of a turn
    in_gap: int = 0  # segment ends where the set has no pause, in a silence as long as the pause
    mid_word: int = 0  # ... in a shorter one


def endpointer_runs(rendered: list[RenderedTurn], noise_dbfs: float | None, pause_ms: int) -> dict[str, EndpointerRun]:
    """The endpointer over every turn (lead-in, the turn, 1 s of silence), the hangover cut on and off."""
    rng = np.random.default_rng(0)
    config = EndpointConfig(endpoint_silence_ms=pause_ms)
    runs = {"hangover cut": EndpointerRun([]), "hangover kept": EndpointerRun([])}
    for r in rendered:
        lead = int(LEAD_S * SAMPLE_RATE)
        clean = np.concatenate([np.zeros(lead, np.float32), r.audio, np.zeros(SAMPLE_RATE, np.float32)])
        audio = clean if noise_dbfs is None else clean + rng.standard_normal(len(clean)).astype(np.float32) * 10 ** (noise_dbfs / 20)
        windows = endpoint.Endpointer(config).cut(audio)
        probabilities = endpoint.SileroVad().probabilities(windows)
        loud = np.nonzero(np.abs(clean) >= SILENT)[0]
        pauses = [(lead + a * SAMPLE_RATE, lead + b * SAMPLE_RATE) for a, b in r.pauses]
        true_end = lead + r.end_s * SAMPLE_RATE
        for name, run in runs.items():
            saved = endpoint.HANGOVER_WINDOWS_MAX
            endpoint.HANGOVER_WINDOWS_MAX = saved if name == "hangover cut" else 0
            try:
                endpointer = endpoint.Endpointer(config)
                decided = []  # (speech end sample, decided at sample)
                for i in range(len(windows)):
                    for event in endpointer.decide(windows[i : i + 1], probabilities[i : i + 1]):
                        if event.kind is endpoint.EventKind.END:
                            decided.append((event.speech_end_sample, endpointer.samples_seen))
            finally:
                endpoint.HANGOVER_WINDOWS_MAX = saved
            for speech_end, at in decided:
                if at >= true_end:
                    run.lags_ms.append((speech_end - true_end) * 1000 / SAMPLE_RATE)
                elif not any(a <= at <= b for a, b in pauses):
                    before = loud[loud < speech_end + endpoint.WINDOW]
                    after = loud[loud > (before[-1] if len(before) else 0)]
                    gap_ms = ((after[0] if len(after) else len(clean)) - (before[-1] if len(before) else 0)) * 1000 / SAMPLE_RATE
                    if gap_ms >= pause_ms:
                        run.in_gap += 1
                    else:
                        run.mid_word += 1
    return runs


def print_endpointer(rendered: list[RenderedTurn]) -> float:
    """The endpointer's table; returns the median lag of its speech end in digital silence."""
    print("the endpointer: speech end after the true end (ms, p50 / p95 / max over the turns' ends), and segment "
          "ends where the set has no pause (in a gap as long as the pause / mid-word)")
    print(f"{'room':>10} {'pause':>6}  {'hangover kept':>32}  {'hangover cut':>32}")
    quiet_lag = float("nan")
    for noise in NOISE_DBFS:
        for pause_ms in (EndpointConfig().smart_pause_ms, EndpointConfig().endpoint_silence_ms):
            runs = endpointer_runs(rendered, noise, pause_ms)
            cells = []
            for name in ("hangover kept", "hangover cut"):
                run = runs[name]
                lags = np.array(run.lags_ms)
                cells.append(f"{np.percentile(lags, 50):>4.0f} / {np.percentile(lags, 95):>4.0f} / {lags.max():>4.0f}"
                             f"  {run.in_gap:>3} / {run.mid_word:<3}")
                if name == "hangover cut" and noise is None:
                    quiet_lag = float(np.percentile(lags, 50))
            room = "silence" if noise is None else f"{noise} dBFS"
            print(f"{room:>10} {pause_ms:>4} ms  {cells[0]:>32}  {cells[1]:>32}")
    return quiet_lag


def boundaries(rendered: list[RenderedTurn], model: SmartTurn, hangover_ms: int,
               chains: list[list[int]] | None = None, stop_at: float = 1.0) -> list[Boundary]:
    """Every pause and end of `rendered`, the model asked at the silences of `chains` (GRID_MS if
    none) the boundary lasts for. Each chain is asked in order of silence and no further once an
    answer reaches `stop_at`: a policy of a threshold up to it, asking along that chain, has ended
    the turn there (so a replay of such policies needs no more; 1.0: the whole chain)."""
    chains = chains or [GRID_MS]
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
        open_chains = [[ms for ms in chain if ms + hangover_ms < length_ms - WINDOW_MS] for chain in chains]
        if stop_at >= 1:  # every answer: in batches
            p = _answers(model, speech, hangover_ms, [ms for chain in open_chains for ms in chain])
        else:  # a step of every open chain at a time
            p, step = {}, 0
            while any(step < len(chain) for chain in open_chains):
                open_chains = [chain for chain in open_chains if step < len(chain)]
                p.update(_answers(model, speech, hangover_ms, [chain[step] for chain in open_chains]))
                open_chains = [chain for chain in open_chains if p[chain[step]] < stop_at]
                step += 1
        out.append(Boundary(r.item.name, halves[r.item.name], r.item.language, is_end, length_ms, p))
    return out


def _answers(model: SmartTurn, speech: np.ndarray, hangover_ms: int, silences_ms: list[int]) -> dict[int, float]:
    """The model's answers about `speech` followed by each silence (plus the hangover), kept on disk:
    a set of 180 turns is ~4000 calls, 6-10 minutes of a loaded core, and the benchmarks ask the same."""
    digest = hashlib.sha1(speech.tobytes())
    digest.update(f"{hangover_ms} {model.path} {model.path.stat().st_size}".encode())
    path = Path(tempfile.gettempdir()) / "voicebot-turn-set" / "smart-turn" / f"{digest.hexdigest()}.json"
    known = {int(ms): p for ms, p in json.loads(path.read_text()).items()} if path.is_file() else {}
    missing = sorted({ms for ms in silences_ms if ms not in known})
    if missing:
        windows = [np.concatenate([speech, np.zeros(SAMPLE_RATE * (ms + hangover_ms) // 1000, np.float32)]) for ms in missing]
        probabilities = np.concatenate([model.predict(windows[j : j + 16]) for j in range(0, len(windows), 16)])
        known.update(zip(missing, map(float, probabilities)))
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(known))
        os.replace(partial, path)
    return {ms: known[ms] for ms in silences_ms}


@dataclass(frozen=True)
class Policy:
    name: str
    pause_ms: int | None  # None: the silence rule
    reask_ms: int = 320
    threshold: float = 0.5
    limit_ms: int = 1500
    early_ms: int = 0  # the first question asked this soon about the pause (TurnPolicy's smart_early_ms); 0: at it

    def decide(self, b: Boundary, hangover_ms: int, model_ms: int) -> float | None:
        """Real silence (ms) when the turn is ended at this boundary; None if the user went on first.

        An early question is answered with the pause's own probability (in digital silence its
        padded input is the pause's input); a "complete" before the pause is held until it."""
        limit = (self.limit_ms if self.pause_ms is not None else 500) + hangover_ms
        if self.pause_ms is not None:
            ask = self.early_ms or self.pause_ms
            while ask + hangover_ms < min(limit, b.length_ms):
                asked_for = max(ask, self.pause_ms)
                at = _on_grid(asked_for)
                if at not in b.p:
                    break
                answered = max(ask + model_ms, self.pause_ms) + hangover_ms
                if b.p[at] >= self.threshold and answered < b.length_ms:
                    return min(answered, limit)
                # One question at a time: the next at the first step of the schedule after its answer.
                following = asked_for + self.reask_ms
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


def cut_and_latency(policy: Policy, bs: list[Boundary], hangover_ms: int, model_ms: int) -> tuple[int, int, float, float]:
    """Turns with a false cut-in, turns, and the decided p50 / p95 (ms of real silence) of the ends."""
    cut = {b.turn for b in bs if not b.is_end and policy.decide(b, hangover_ms, model_ms) is not None}
    ends = np.array([policy.decide(b, hangover_ms, model_ms) for b in bs if b.is_end], float)
    return len(cut), len({b.turn for b in bs}), float(np.percentile(ends, 50)), float(np.percentile(ends, 95))


EARLY_GRID = list(itertools.product((0, 32, 64, 96), (0.5, 0.6, 0.7, 0.8), (160, 192, 224)))  # early x threshold x pause


def asked_chains(reask_ms: int, limit_ms: int) -> list[list[int]]:
    """The silences EARLY_GRID's policies ask about, one chain per pause (an early question stands
    for its pause; re-asks follow it): all a replay of them needs, a third of GRID_MS."""
    pauses = sorted({pause for _, _, pause in EARLY_GRID})
    return [[_on_grid(pause + k * reask_ms) for k in range(limit_ms // reask_ms + 1) if pause + k * reask_ms < limit_ms]
            for pause in pauses]


def early_grid(bs: list[Boundary], hangover_ms: int, model_ms: int, reask_ms: int, label: str = "") -> None:
    """Every early x threshold x pause setting beside the silence rule, on both halves; the pick is
    the fastest (p50, then p95, then the fewest cut-ins) on half 0 with no more cut-ins than the
    silence rule there."""
    silence = Policy("silence 500", None)
    grid = [Policy(f"early {e:>2} {p} @{t}", p, reask_ms, t, early_ms=e) for e, t, p in EARLY_GRID]
    rows = {policy: [cut_and_latency(policy, [b for b in bs if b.half == h], hangover_ms, model_ms) for h in (0, 1)]
            for policy in [silence, *grid]}
    allowed = rows[silence][0][0]
    pick = min((p for p in grid if rows[p][0][0] <= allowed), key=lambda p: (*rows[p][0][2:], rows[p][0][0]), default=None)
    print(f"\n{label}answer {model_ms} ms, re-ask {reask_ms} ms: cut-ins and decided p50 / p95 (ms), half 0 (tuning) | half 1 (held out)")
    for policy, halves in rows.items():
        cells = "  |  ".join(f"{c:>2}/{n:<2} {p50:>5.0f} {p95:>5.0f}" for c, n, p50, p95 in halves)
        mark = "  <- pick (half 0)" if policy is pick else ""
        print(f"{policy.name:>16}  {cells}{mark}")
    if pick is None:
        print(f"no setting has cut-ins <= the silence rule's ({allowed}) on half 0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hangover-ms", type=int, default=None)
    parser.add_argument("--model-ms", type=int, default=70)
    parser.add_argument("--voice", choices=VOICES, default="espeak")
    args = parser.parse_args()

    rendered = render_all(turn_set(args.voice), voice=args.voice)
    lag_ms = print_endpointer(rendered)
    if args.hangover_ms is None:
        args.hangover_ms = round(lag_ms + 20)  # and half the mic page's 40 ms chunk
    print()
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
