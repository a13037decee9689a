"""Turn policies replayed offline on eot-bench's axes: cut-off rate against mean latency.

    python bench/turn_offline.py [--voices espeak piper piper-turn] [--model-ms 80] [--hangover-ms 32]
                                 [--text-ms 64] [--plot docs/turn-taking.png] [--endpointer]
                                 [--languages zh] [--punctuated zh] [--margins 0 1 2]

No server, no clock: Smart Turn is asked about each boundary of tests/turn_set.py (each pause
inside a turn, each true end) with the audio a session would give it: the turn so far from
`pre_speech_ms` before its speech (zero-padded at the front to 8 s, as pipecat does) plus the
silence heard when it asks, on a 32 ms grid of silences (the VAD's window). The product's own
`TurnPolicy` (voicebot/audio/turn.py) is then driven over those answers window by window, as
voicebot/session/turn_taking.py drives it: each answer `--model-ms` after its question, the
segment's transcript (the set's words, unpunctuated, as pocketsphinx and paraformer give them;
the recognizer's errors are not modelled; `--punctuated zh`: the Mandarin text as the set writes it,
"我想要，" at a pause and "。" or "？" at the end, as a recognizer with a punctuation model that
never errs gives it: asr.paraformer.punc_model's best case) `--text-ms` after the smart pause ended the segment,
a "complete" said before the transcript waiting for it. A cut-off is a turn in which some pause
was decided "complete" before the user went on; the latency of an end is the real silence
(VAD silence plus `--hangover-ms`) when it was decided.

The axes are LiveKit eot-bench's: for each policy family, every setting of its sweep (threshold,
action delay = `smart_pause_ms`, timeout = `smart_limit_ms`, ...) gives a point (mean latency,
cut-off rate); the curve is the settings on the lower-left frontier. The budgets: the cut-off
rate at a mean latency of at most 300 / 600 ms, and the mean latency at a cut-off rate of at most
5 / 10 %. Every pick is made on half 0 of a set (even-numbered turns of each group) and reported
on half 1, the held-out half. Cut-off rate: turns cut off / all turns of the half (paused and
complete), so a policy that never cuts in reads 0 % and the silence rule's rate is its anchor.

The model's answers are kept on disk (the temp dir's voicebot-turn-set/smart-turn/, keyed by the
audio, the hangover and the model file): a set is some thousands of calls, minutes of a core, and
a second run costs the replay only. `--voices`: tests/turn_set.py's voices (piper, piper-turn:
English, natural prosody; pip install '.[bench]').

`--languages`: only the set's turns in these languages (each keeps the half it has in the whole set).

`--endpointer`: only the endpointer itself on the set (voicebot/audio/endpoint.py, Silero's own
probabilities), with and without its hangover cut (the quiet speech windows before a silence
counted as silence), in digital silence and in white room noise: where it says speech ended, after
the true end (what `--hangover-ms` stands for), and its segment ends that fall where the set has
no pause. Such an end is "in a gap" when the speech there really is silent for the pause's length
(espeak-ng's comma pauses; an end just as a set pause is over), else "mid-word".
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
from voicebot.audio.turn import Action, SmartTurn, TurnPolicy  # noqa: E402
from voicebot.audio.turn_words import unpunctuated  # noqa: E402
from voicebot.config.stages import EndpointConfig  # noqa: E402
from voicebot.serving.silero import SileroVad  # noqa: E402

WINDOW_MS = 32
# VAD silences the model may be asked at: from the shortest swept pause to the last question a 1.5 s
# timeout asks (one whose answer comes before it). The sets are asked only at those the sweep's
# schedules ask at (`asked_grid`); a question off it is an error, not a guess.
GRID_MS = list(range(160, 1440, WINDOW_MS))
PRE_SPEECH_MS = EndpointConfig().pre_speech_ms
HANGOVER_MS = 32  # the endpointer's median lag after the true end (12 ms, --endpointer) and half a 40 ms chunk
TEXT_MS = 64  # the segment's transcript after the pause ended it (pocketsphinx's finish: 38 ms p50) and a chunk
MODEL_MS = 80  # one call's answer at one client (bench/latency.py: 85-96 ms p50 idle)


@dataclass(frozen=True)
class Boundary:
    turn: str
    half: int  # 0: tuning half, 1: held out
    language: str
    is_end: bool  # the true end of the turn; else a pause inside it
    length_ms: float  # the pause's length (inf for an end)
    text: str  # the words said up to here, as the recognizer gives them (unpunctuated unless --punctuated)
    p: dict[int, float]  # VAD silence heard (ms, on GRID_MS) -> the model's probability of "complete"


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
        probabilities = SileroVad().probabilities(windows)
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



def boundaries(rendered: list[RenderedTurn], model: SmartTurn, hangover_ms: int, grid: list[int] | None = None,
               punctuated: frozenset[str] = frozenset()) -> list[Boundary]:
    """Every pause and end of `rendered`, the model asked at each silence of `grid` (GRID_MS if none)
    the boundary lasts for; the text as the set writes it in the `punctuated` languages, else unpunctuated."""
    grid = grid or GRID_MS
    halves, counts = {}, {}
    for r in rendered:
        group = (r.item.language, r.item.paused)
        halves[r.item.name] = counts.get(group, 0) % 2
        counts[group] = counts.get(group, 0) + 1
    out = []
    for r in rendered:
        joiner = "" if r.item.language == "zh" else " "
        starts = [(start, False, (end - start) * 1000) for start, end in r.pauses] + [(r.end_s, True, float("inf"))]
        for k, (start, is_end, length_ms) in enumerate(starts):
            speech = np.concatenate([np.zeros(SAMPLE_RATE * PRE_SPEECH_MS // 1000, np.float32), r.audio[: int(start * SAMPLE_RATE)]])
            # The silences a policy can ask at: the pause itself, less the window that would hear speech again.
            silences = [ms for ms in grid if ms + hangover_ms < length_ms - WINDOW_MS]
            text = joiner.join(r.item.parts[: k + 1])
            if r.item.language not in punctuated:
                text = unpunctuated(text)
            out.append(Boundary(r.item.name, halves[r.item.name], r.item.language, is_end, length_ms, text,
                                _answers(model, speech, hangover_ms, silences)))
    return out


def _answers(model: SmartTurn, speech: np.ndarray, hangover_ms: int, silences_ms: list[int]) -> dict[int, float]:
    """The model's answers about `speech` followed by each silence (plus the hangover), kept on disk:
    a set of 180 turns is ~8000 calls, 10-15 minutes of a loaded core, and the benchmarks ask the same."""
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
class Decision:
    at_ms: float | None  # real silence after the boundary's start when the turn was ended; None: the user went on first
    questions: int  # the model's calls meanwhile


def decide(config: EndpointConfig, b: Boundary, hangover_ms: int = HANGOVER_MS, model_ms: int = MODEL_MS,
           text_ms: int = TEXT_MS) -> Decision:
    """The product's TurnPolicy over one boundary, fed 32 ms windows of silence as the session
    feeds it (voicebot/session/turn_taking.py): the answer to each question `model_ms` after it,
    the segment's transcript `text_ms` after the smart pause ended it; a "complete" before the
    transcript waits for it (TurnTaking's `_complete_early`), which then weighs in (`on_text`)."""
    policy = TurnPolicy(config, smart=config.turn == "smart")
    policy.answer_ms = model_ms  # a session's policy carries its last answer's time from turn to turn
    resume_ms = b.length_ms - hangover_ms  # VAD silence when the user is heard again
    text_at = config.smart_pause_ms + text_ms if policy.smart else float("inf")
    text_in = not policy.smart  # the transcript has come (the silence rule does not wait for it)
    answer: tuple[float, int, float] | None = None  # (due at, question, probability)
    questions = 0

    def ended(at: float) -> Decision:
        return Decision(at + hangover_ms, questions)

    silence = 0
    while True:
        silence += WINDOW_MS
        # What came in before this window, in the order it came: the answer, the transcript.
        due = sorted(([(answer[0], "answer")] if answer is not None and answer[0] <= silence else [])
                     + ([(text_at, "text")] if not text_in and text_at <= silence else []))
        for at, kind in due:
            if at >= resume_ms:
                return Decision(None, questions)
            if kind == "answer":
                _, question, probability = answer
                answer = None
                if policy.on_answer(question, probability, at) and text_in:
                    return ended(at)
            else:
                text_in = True
                if policy.on_text(b.text, at):
                    return ended(at)
        if silence >= resume_ms:
            return Decision(None, questions)
        action = policy.on_silence(silence)
        if action is Action.END or (action is Action.COMPLETE and text_in):
            return ended(silence)
        if action is Action.ASK:
            questions += 1
            asked_for = int(policy.asked_for_ms)
            if asked_for in b.p:
                answer = (silence + model_ms, policy.question, b.p[asked_for])
            elif b.is_end:
                raise KeyError(f"no answer at {asked_for} ms of silence: GRID_MS ends at {GRID_MS[-1]}")
            # else: the question's window would hear the user again; its answer comes after they did


@dataclass(frozen=True)
class Point:
    """One policy setting on one half of a set."""

    cut: float  # share of the half's turns cut off
    mean_ms: float  # mean latency over the true ends
    p95_ms: float
    questions: float  # the model's calls per turn (at its pauses and its end)
    n: int  # turns


# ---- the sweep: each family's settings (pauses and re-asks on the 32 ms window grid) ----------------
THRESHOLDS = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
# The action delay (the first question): 160-640 ms, each on the other schedules' silences (no new calls).
PAUSES_MS = (160, 192, 320, 480, 640)
LIMITS_MS = (704, 896, 1024, 1280, 1500)
WORDS = {"hold": {"smart_words_hold": 3.0}, "go": {"smart_words_go": 2.0}}
NO_WORDS = {"smart_words_hold": 0.0, "smart_words_go": 0.0}


def families() -> dict[str, list[EndpointConfig]]:
    """Policy families and the settings each is swept over. The pauses and re-asks are few: each
    schedule's silences are model calls on every boundary of a set (`asked_grid`: 12 silences, some
    3,000 calls for the natural-voice set, half an hour of a shared core)."""
    silence = [EndpointConfig(turn="silence", endpoint_silence_ms=ms)
               for ms in sorted({*range(192, 1536, 64), EndpointConfig().endpoint_silence_ms})]
    # Today's shape: one threshold, a re-ask every 320 ms, the timeout.
    flat = [EndpointConfig(smart_pause_ms=pause, smart_reask_ms=320, smart_threshold=t, smart_threshold_floor=t,
                           smart_limit_ms=limit, **NO_WORDS)
            for pause, t, limit in itertools.product(PAUSES_MS, THRESHOLDS, LIMITS_MS) if pause < limit]
    # The long tail's: asked again sooner, the threshold falling with the silence to the timeout.
    falling_grid = [dict(smart_pause_ms=pause, smart_reask_ms=reask, smart_threshold=t, smart_threshold_floor=floor,
                         smart_limit_ms=limit)
                    for pause, reask, t, drop, limit in itertools.product((160, 320, 480, 640), (160,), THRESHOLDS,
                                                                           (0.2, 0.4, 0.6), LIMITS_MS)
                    if (floor := round(t - drop, 2)) >= 0.1 and pause < limit]
    out = {"silence": silence, "smart, flat (today's)": flat,
           "smart, falling": [EndpointConfig(**s, **NO_WORDS) for s in falling_grid]}
    out["falling + hold words"] = [EndpointConfig(**s, **{**NO_WORDS, **WORDS["hold"]}) for s in falling_grid]
    out["falling + go words"] = [EndpointConfig(**s, **{**NO_WORDS, **WORDS["go"]}) for s in falling_grid]
    out["falling + both"] = [EndpointConfig(**s, **WORDS["hold"], **WORDS["go"]) for s in falling_grid]
    return out


def asked_grid(configs: list[EndpointConfig]) -> list[int]:
    """The silences the settings' schedules ask at while each answer comes back within a re-ask
    (pause, pause + reask, ... before the timeout)."""
    asked = {ms for c in configs if c.turn == "smart"
             for ms in range(c.smart_pause_ms, c.smart_limit_ms, c.smart_reask_ms)}
    asked |= {EndpointConfig().smart_pause_ms}  # bench/smart_turn.py --replay's first question
    return sorted(ms for ms in asked if ms in GRID_MS)


def frontier(points: dict[str, Point]) -> list[str]:
    """The settings no other beats on both axes (lower mean latency and no more cut-offs), by latency."""
    ordered = sorted(points, key=lambda c: (points[c].mean_ms, points[c].cut))
    out, best_cut = [], float("inf")
    for config in ordered:
        if points[config].cut < best_cut:
            out.append(config)
            best_cut = points[config].cut
    return out


def at_latency(points: dict[str, Point], budget_ms: float) -> str | None:
    """The setting with the fewest cut-offs at a mean latency within the budget (then the fastest)."""
    fits = [c for c in points if points[c].mean_ms <= budget_ms]
    return min(fits, key=lambda c: (points[c].cut, points[c].mean_ms), default=None)


def at_cut(points: dict[str, Point], budget: float) -> str | None:
    """The fastest setting with at most the budget's share of turns cut off (then the fewest)."""
    fits = [c for c in points if points[c].cut <= budget + 1e-9]
    return min(fits, key=lambda c: (points[c].mean_ms, points[c].cut), default=None)


def describe(config: EndpointConfig) -> str:
    if config.turn == "silence":
        return f"silence {config.endpoint_silence_ms}"
    words = "".join(f" {k[12:]} {getattr(config, k):g}" for k in ("smart_words_hold", "smart_words_go") if getattr(config, k))
    threshold = (f"{config.smart_threshold:g}" if config.smart_threshold_floor == config.smart_threshold
                 else f"{config.smart_threshold:g}->{config.smart_threshold_floor:g}")
    return (f"@{threshold} pause {config.smart_pause_ms} reask {config.smart_reask_ms} "
            f"limit {config.smart_limit_ms}{words}")


def evaluate_all(configs: dict[str, EndpointConfig], bs: list[Boundary], **timing) -> dict[str, tuple[Point, Point]]:
    """Every setting on both halves. A boundary whose words give no cue is decided once for the
    settings that differ only in the words' weights."""
    from voicebot.audio.turn_words import Cue, cue

    cues = {id(b): cue(b.text) for b in bs}
    memo: dict[tuple, Decision] = {}

    def decided(config: EndpointConfig, b: Boundary) -> Decision:
        weight = {Cue.HOLD: config.smart_words_hold, Cue.GO: config.smart_words_go}.get(cues[id(b)], 0.0)
        key = (describe(config.model_copy(update={"smart_words_hold": 0.0, "smart_words_go": 0.0})), weight, id(b))
        if key not in memo:
            memo[key] = decide(config, b, **timing)
        return memo[key]

    out = {}
    for name, config in configs.items():
        halves = []
        for half in (0, 1):
            part = [b for b in bs if b.half == half]
            turns = {b.turn for b in part}
            ds = [(b, decided(config, b)) for b in part]
            cut = {b.turn for b, d in ds if not b.is_end and d.at_ms is not None}
            ends = np.array([d.at_ms for b, d in ds if b.is_end], float)
            halves.append(Point(len(cut) / len(turns), float(ends.mean()), float(np.percentile(ends, 95)),
                                sum(d.questions for _, d in ds) / len(turns), len(turns)))
        out[name] = (halves[0], halves[1])
    return out


BUDGETS_MS = (300, 600)
BUDGETS_CUT = (0.05, 0.10)
# The operating points marked on the curves: the config's default, the one before it, the silence rule.
MARKED = {
    "the default": EndpointConfig(),
    "the previous default": EndpointConfig(smart_pause_ms=192, smart_reask_ms=320, smart_threshold=0.8,
                                           smart_threshold_floor=0.8, smart_limit_ms=1500, smart_words_hold=0.0,
                                           smart_words_go=0.0),
    "the silence rule": EndpointConfig(turn="silence"),
}
Results = dict[str, dict[str, tuple[Point, Point]]]  # family -> setting -> (half 0, half 1)


def cell(point: Point | None, axis: str) -> str:
    if point is None:
        return "-"
    return f"{100 * point.cut:.1f}% ({point.mean_ms:.0f})" if axis == "cut" else f"{point.mean_ms:.0f} ({100 * point.cut:.1f}%)"


def print_voice(voice: str, bs: list[Boundary], results: Results, marks: dict[str, tuple[Point, Point]]) -> None:
    n0, n1 = (len({b.turn for b in bs if b.half == h}) for h in (0, 1))
    print(f"\n== {voice}: {n0} + {n1} turns ({', '.join(sorted({b.language for b in bs}))}); each setting picked on "
          f"half 0, its figure on half 1 (held out); '-': no setting meets the budget on half 0")
    print(f"{'family':>22}  " + "".join(f"{'cut-offs @' + str(ms) + ' ms':>17}" for ms in BUDGETS_MS)
          + "".join(f"{'mean ms @' + str(round(100 * c)) + '% cut':>19}" for c in BUDGETS_CUT))
    for family, points in results.items():
        tuning = {name: halves[0] for name, halves in points.items()}
        cells = [cell(points[pick][1] if (pick := at_latency(tuning, ms)) else None, "cut") for ms in BUDGETS_MS]
        cells += [cell(points[pick][1] if (pick := at_cut(tuning, c)) else None, "ms") for c in BUDGETS_CUT]
        print(f"{family:>22}  " + "".join(f"{c:>17}" for c in cells[:2]) + "".join(f"{c:>19}" for c in cells[2:]))
    print("the curves: half 0's frontier, each setting's mean ms / cut-off % on half 1")
    for family, points in results.items():
        curve = frontier({name: halves[0] for name, halves in points.items()})
        print(f"{family:>22}  " + " ".join(f"{points[c][1].mean_ms:.0f}/{100 * points[c][1].cut:.0f}" for c in curve))
    print("operating points, half 0 | half 1: cut-offs, mean / p95 latency ms, model calls per turn")
    for label, halves in marks.items():
        row = "  |  ".join(f"{100 * h.cut:5.1f}% {h.mean_ms:5.0f} / {h.p95_ms:5.0f}  {h.questions:4.1f}" for h in halves)
        print(f"{label + ': ' + describe(MARKED[label]):>68}  {row}")


def choose(per_voice: dict[str, Results], silence: dict[str, tuple[Point, Point]], natural: str, family: str,
           p95_ms: float, margin: int = 0) -> str | None:
    """A pick on half 0 only: the lowest mean latency on the natural voice's set with a p95 within
    `p95_ms` there and at least `margin` turns fewer cut off than the silence rule on every set or
    voice (a margin keeps the pick off the edge it is picked at)."""
    def fits(name: str) -> bool:
        return (all(results[family][name][0].cut * silence[voice][0].n <= silence[voice][0].cut * silence[voice][0].n - margin + 1e-9
                    for voice, results in per_voice.items())
                and per_voice[natural][family][name][0].p95_ms <= p95_ms)

    return min((name for name in per_voice[natural][family] if fits(name)),
               key=lambda name: per_voice[natural][family][name][0].mean_ms, default=None)


def plot(path: Path, per_voice: dict[str, Results], marks: dict[str, dict[str, tuple[Point, Point]]], note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"the default": ("*", 16, "black"), "the previous default": ("^", 10, "dimgrey"),
              "the silence rule": ("s", 9, "grey")}
    fig, axes = plt.subplots(1, len(per_voice), figsize=(6.5 * len(per_voice), 5.2), squeeze=False)
    for ax, (voice, results) in zip(axes[0], per_voice.items()):
        for family, points in results.items():
            curve = frontier({name: halves[0] for name, halves in points.items()})
            held = sorted((points[c][1].mean_ms, 100 * points[c][1].cut) for c in curve)
            ax.plot([x for x, _ in held], [y for _, y in held], marker=".", label=family,
                    linestyle="--" if family == "silence" else "-")
        for label, (marker, size, colour) in styles.items():
            h = marks[voice][label][1]
            ax.plot(h.mean_ms, 100 * h.cut, marker=marker, markersize=size, color=colour, linestyle="none",
                    label=f"{label} (p95 {h.p95_ms:.0f} ms)")
        for ms in BUDGETS_MS:
            ax.axvline(ms, color="lightgrey", linewidth=0.8)
        for c in BUDGETS_CUT:
            ax.axhline(100 * c, color="lightgrey", linewidth=0.8)
        ax.set_title(f"{voice}{note}: held-out half (each curve's settings picked on the other)", fontsize=10)
        ax.set_xlabel("mean latency, true end of turn to decision (ms)")
        ax.set_ylabel("turns cut off (%)")
        ax.set_xlim(150, 1600)
        ax.set_ylim(0, None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--voices", nargs="+", choices=VOICES, default=["espeak"])
    parser.add_argument("--hangover-ms", type=int, default=HANGOVER_MS)
    parser.add_argument("--model-ms", type=int, default=MODEL_MS)
    parser.add_argument("--text-ms", type=int, default=TEXT_MS)
    parser.add_argument("--p95-ms", type=float, default=1100, help="the p95 bound of the picks for a default")
    parser.add_argument("--margins", nargs="+", type=int, default=[0],
                        help="picks with at least this many turns fewer cut off than the silence rule on each half 0")
    parser.add_argument("--plot", type=Path, help="write the curves here (PNG; matplotlib: pip install '.[bench]')")
    parser.add_argument("--endpointer", action="store_true", help="only the endpointer's table, for each of --voices")
    parser.add_argument("--languages", nargs="+", choices=("en", "zh"), help="only the turns in these languages")
    parser.add_argument("--punctuated", nargs="+", choices=("en", "zh"), default=[],
                        help="the text in these languages punctuated as the set writes it (a punctuation model's best case)")
    args = parser.parse_args()

    if args.endpointer:
        for voice in args.voices:
            print(voice)
            print_endpointer(render_all(turn_set(voice), voice=voice))
        return
    timing = dict(hangover_ms=args.hangover_ms, model_ms=args.model_ms, text_ms=args.text_ms)
    swept = families()
    grid = asked_grid([c for family in swept.values() for c in family] + list(MARKED.values()))
    model = SmartTurn()
    per_voice: dict[str, Results] = {}
    marks: dict[str, dict[str, tuple[Point, Point]]] = {}
    sets = {}
    for voice in args.voices:
        t0 = time.monotonic()
        rendered = [r for r in render_all(turn_set(voice), voice=voice)
                    if args.languages is None or r.item.language in args.languages]
        bs = sets[voice] = boundaries(rendered, model, args.hangover_ms, grid, frozenset(args.punctuated))
        t1 = time.monotonic()
        evaluated = evaluate_all({describe(c): c for family in swept.values() for c in family}, bs, **timing)
        per_voice[voice] = {family: {describe(c): evaluated[describe(c)] for c in cs} for family, cs in swept.items()}
        marks[voice] = {label: evaluate_all({label: c}, bs, **timing)[label] for label, c in MARKED.items()}
        print(f"{voice}: {len(bs)} boundaries, {sum(len(b.p) for b in bs)} answers in {t1 - t0:.0f} s; "
              f"{len(evaluated)} settings replayed in {time.monotonic() - t1:.0f} s")
    model.close()
    print(f"\nanswer {args.model_ms} ms after its question, hangover {args.hangover_ms} ms, transcript {args.text_ms} ms "
          f"after the pause; cut-offs: turns cut off / all turns of the half")
    for voice, results in per_voice.items():
        print_voice(voice, sets[voice], results, marks[voice])
    natural = next((v for v in ("piper-turn", "piper") if v in per_voice), args.voices[0])
    silence = {voice: m["the silence rule"] for voice, m in marks.items()}
    for margin in args.margins:
        print(f"\npicks for a default, on half 0 (the lowest mean latency on {natural} with p95 <= {args.p95_ms:.0f} ms "
              f"there and at least {margin} turns fewer cut off than the silence rule on every set), and what they do on half 1:")
        for family in swept:
            if family == "silence":
                continue
            name = choose(per_voice, silence, natural, family, args.p95_ms, margin)
            rows = "; ".join(f"{voice} {cell(r[family][name][1], 'ms')} p95 {r[family][name][1].p95_ms:.0f}"
                             for voice, r in per_voice.items()) if name else "none fits"
            print(f"{family:>22}: {name or ''}  -> {rows}")
    print(f"{'the silence rule':>22}: " + "; ".join(f"{voice} {cell(m[1], 'ms')}" for voice, m in silence.items()))
    if args.plot:
        note = (f" {'+'.join(args.languages)}" if args.languages else "") + (
            f", {'+'.join(args.punctuated)} punctuated" if args.punctuated else "")
        plot(args.plot, per_voice, marks, note)


if __name__ == "__main__":
    main()
