"""Smart Turn v3.2 on this CPU: where a call's time goes, what onnxruntime's options change, and
how much its answer moves with the trailing silence it hears.

    OMP_NUM_THREADS=1 python bench/smart_turn.py [--calls 15] [--skip-speed] [--replay] [--parts] [--memory]
                                                 [--voices espeak piper]

1. One call at batch 1: the features (transformers' WhisperFeatureExtractor) and the ONNX model,
   each timed alone, p50 / p95 over `--calls`, for each graph optimisation level and intra-op
   thread count, side by side in one run. Whether the model takes a window shorter than 8 s.
2. On tests/turn_set.py (espeak), every boundary (each pause inside a turn, each true end) asked
   with 0-160 ms of trailing silence (plus the endpointer's hangover): how far the probability
   moves from its value at the smart pause (160 ms), and how often the 0.5 decision differs. This
   is what decides whether an answer computed at the first silent window may stand for the one at
   the pause (voicebot/audio/turn.py, `TurnPolicy`'s early question).
3. `--replay`: the model's answers on the turn sets (bench/turn_offline.py's, cached on disk), for
   each of `--voices` (tests/turn_set.py's espeak set; the piper set, natural prosody, English, more
   turns, its parts voiced alone (piper) or each paused turn voiced whole and cut at its commas
   (piper-turn); the piper voices need pip install '.[bench]'): how often the model says "complete"
   at a true end (its first question, at the default pause; any decision of the default policy
   before its timeout) and inside a pause (first question; any decision before the user goes on),
   also on the English items both sets share (the voice's effect alone); and the true ends the
   default leaves to its timeout. The policies' curves on these answers: bench/turn_offline.py.
4. `--memory`: only the memory a batch leaves held, with onnxruntime's CPU arena (its default) and
   without it (the server's SmartTurn): RSS above the loaded model after each batch of a sequence
   (1, 2, 4, 8, 2, 1, 8), each variant in a fresh process; then each batch's time, both
   variants interleaved in one process.
5. `--parts`: only the check of each voice's English parts: the quiet left at their ends by the
   trim, flat tops (clipping), and the pitch at a comma-ended part's end against a full stop's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.turn_set import SAMPLE_RATE, TURNS, VOICES, render_all, turn_set  # noqa: E402
from voicebot.audio.turn import WINDOW_SAMPLES, SmartTurn, last_window, model_path, with_silence  # noqa: E402
from voicebot.config.stages import EndpointConfig  # noqa: E402

HANGOVER_MS = 32  # bench/turn_offline.py's default: the endpointer's median lag (12 ms) and half a 40 ms chunk
SILENCES_MS = (0, 32, 64, 96, 128, 160)


def pct(values: list[float]) -> str:
    return f"{np.percentile(values, 50) * 1000:6.1f} / {np.percentile(values, 95) * 1000:6.1f}"


def speed(calls: int) -> None:
    import onnxruntime

    audio = np.random.default_rng(0).standard_normal(WINDOW_SAMPLES).astype(np.float32) * 0.1
    model = SmartTurn()
    feature_s = []
    for _ in range(calls):
        t0 = time.perf_counter()
        features = model._features([last_window(audio)], sampling_rate=SAMPLE_RATE, padding="max_length",
                                   max_length=WINDOW_SAMPLES, truncation=True, do_normalize=True,
                                   return_tensors="np").input_features.astype(np.float32)
        feature_s.append(time.perf_counter() - t0)
    print(f"features (numpy WhisperFeatureExtractor), ms p50 / p95: {pct(feature_s)}")
    levels = {"disable_all": onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL}
    sessions = {}
    for threads in (1, 2):
        for name, level in levels.items():
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.graph_optimization_level = level
            sessions[(threads, name)] = onnxruntime.InferenceSession(str(model.path), options, providers=["CPUExecutionProvider"])
    times = {key: [] for key in sessions}
    for _ in range(calls):  # interleaved, so a change in the box's load falls on every variant alike
        for key, session in sessions.items():
            t0 = time.perf_counter()
            session.run(None, {"input_features": features})
            times[key].append(time.perf_counter() - t0)
    print("ONNX model, batch 1, ms p50 / p95 (interleaved):")
    for (threads, name), t in times.items():
        print(f"  intra-op threads {threads}, graph {name:>11}: {pct(t)}")
    for frames in (400, 200):
        try:
            sessions[(1, "all")].run(None, {"input_features": features[:, :, -frames:]})
            print(f"  a {frames // 100} s window ({frames} frames): accepted")
        except Exception as exc:  # onnxruntime's own error type for a shape the graph refuses
            print(f"  a {frames // 100} s window ({frames} frames): refused ({str(exc).splitlines()[0][:120]})")
    model.close()


def trailing_silence() -> None:
    rendered = render_all(TURNS)
    model = SmartTurn()
    pre = np.zeros(SAMPLE_RATE * EndpointConfig().pre_speech_ms // 1000, np.float32)
    rows = []  # (is_end, probabilities by SILENCES_MS)
    for r in rendered:
        for start, end in [*r.pauses, (r.end_s, None)]:
            speech = np.concatenate([pre, r.audio[: int(start * SAMPLE_RATE)]])
            windows = [np.concatenate([speech, np.zeros(SAMPLE_RATE * (ms + HANGOVER_MS) // 1000, np.float32)])
                       for ms in SILENCES_MS]
            rows.append((end is None, model.predict(windows)))
    model.close()
    p = np.array([row[1] for row in rows])
    ends = np.array([row[0] for row in rows])
    at_pause = p[:, -1]
    print(f"\n{len(rows)} boundaries ({ends.sum()} ends, {(~ends).sum()} pauses); VAD silence + {HANGOVER_MS} ms hangover")
    print(f"{'VAD silence':>12} {'|p - p(160)| p50':>17} {'p95':>6} {'max':>6} {'0.5 differs':>12} {'share >= 0.5':>13}")
    for i, ms in enumerate(SILENCES_MS):
        delta = np.abs(p[:, i] - at_pause)
        differs = int(((p[:, i] >= 0.5) != (at_pause >= 0.5)).sum())
        print(f"{ms:>9} ms {np.percentile(delta, 50):>17.3f} {np.percentile(delta, 95):>6.3f} {delta.max():>6.3f} "
              f"{differs:>6}/{len(rows):<5} {100 * np.mean(p[:, i] >= 0.5):>12.0f}%")


def padded_tail(early_ms: int) -> None:
    """The early question's input (the audio up to `early_ms` of VAD silence, its silent tail
    repeated up to the pause) against the pause's real input, in digital silence and in white room
    noise; and, in noise, the pause's input against itself in another noise sample."""
    rendered = render_all(TURNS)
    model = SmartTurn()
    pause_ms = EndpointConfig().smart_pause_ms
    pre_samples = SAMPLE_RATE * EndpointConfig().pre_speech_ms // 1000
    rng = np.random.default_rng(0)
    print(f"\nthe early question at {early_ms} ms, its tail repeated to {pause_ms} ms, against the real {pause_ms} ms input "
          f"(and the real input in another noise sample)")
    print(f"{'room':>10} {'|p_early - p| p50':>18} {'p95':>6} {'max':>6} {'0.5 differs':>12}   {'other noise: differs':>20}")
    for noise_dbfs in (None, -60, -50):
        real, early, other = [], [], []
        for r in rendered:
            for start, _ in [*r.pauses, (r.end_s, None)]:
                cut = pre_samples + int(start * SAMPLE_RATE)
                heard = np.concatenate([np.zeros(pre_samples, np.float32), r.audio])[:cut]
                heard = np.concatenate([heard, np.zeros(SAMPLE_RATE, np.float32)])  # what follows: silence (the ends; a pause's own)
                noise = np.zeros(len(heard), np.float32)
                if noise_dbfs is not None:
                    noise = rng.standard_normal(len(heard)).astype(np.float32) * 10 ** (noise_dbfs / 20)
                heard = heard + noise
                at_pause = heard[: cut + SAMPLE_RATE * (pause_ms + HANGOVER_MS) // 1000]
                at_early = heard[: cut + SAMPLE_RATE * (early_ms + HANGOVER_MS) // 1000]
                at_early = with_silence(at_early, SAMPLE_RATE * (early_ms + HANGOVER_MS) // 1000, len(at_pause) - cut)
                if noise_dbfs is not None:  # the same pause in another sample of the same room: the answer's own spread
                    again = at_pause - noise[: len(at_pause)] + rng.standard_normal(len(at_pause)).astype(np.float32) * 10 ** (noise_dbfs / 20)
                    other.append(again)
                real.append(at_pause)
                early.append(at_early)
        p_real = np.concatenate([model.predict(real[i : i + 16]) for i in range(0, len(real), 16)])
        p_early = np.concatenate([model.predict(early[i : i + 16]) for i in range(0, len(early), 16)])
        delta = np.abs(p_real - p_early)
        differs = int(((p_real >= 0.5) != (p_early >= 0.5)).sum())
        room = "silence" if noise_dbfs is None else f"{noise_dbfs} dBFS"
        spread = "-"
        if other:
            p_other = np.concatenate([model.predict(other[i : i + 16]) for i in range(0, len(other), 16)])
            spread = f"{int(((p_real >= 0.5) != (p_other >= 0.5)).sum())}/{len(other)}"
        print(f"{room:>10} {np.percentile(delta, 50):>18.3f} {np.percentile(delta, 95):>6.3f} {delta.max():>6.3f} "
              f"{differs:>6}/{len(real):<5}   {spread:>20}")
    model.close()


def part_checks(voices: list[str]) -> None:
    """Each voice's English parts (the speech between a turn's pauses): how the trim left their ends,
    flat tops (clipping), and the pitch at a part's end against its median: a comma-ended part
    (said to continue) beside a full stop's and a question's."""
    import librosa

    print("the parts (English): quiet lead / tail kept by the trim (ms to the first / from the last 10 ms frame within "
          "30 dB of the part's peak, p50 / p95 / max), flat tops (3+ samples at 99 % of the peak), and the pitch "
          "(pyin) over the last 150 ms voiced against the part's median, semitones p25 / p50 / p75")
    for voice in voices:
        rendered = [r for r in render_all(turn_set(voice), voice=voice) if r.item.language == "en"]
        lead, tail, flat = [], [], 0
        end_pitch: dict[str, list[float]] = {",": [], ".": [], "?": []}
        for r in rendered:
            bounds = [0.0, *(x for pause in r.pauses for x in pause), r.end_s]
            for text, (a, b) in zip(r.item.parts, zip(bounds[::2], bounds[1::2])):
                part = r.audio[round(a * SAMPLE_RATE) : round(b * SAMPLE_RATE)]
                frames = np.sqrt(np.mean(part[: len(part) // 160 * 160].reshape(-1, 160) ** 2, axis=1))
                loud = np.nonzero(frames >= np.abs(part).max() * 10 ** (-30 / 20))[0]
                lead.append(loud[0] * 10.0)
                tail.append((len(frames) - 1 - loud[-1]) * 10.0)
                at_peak = np.abs(part) >= 0.99 * np.abs(part).max()
                flat += int(np.any(at_peak[:-2] & at_peak[1:-1] & at_peak[2:]))
                f0, voiced, _ = librosa.pyin(part, fmin=60, fmax=400, sr=SAMPLE_RATE, frame_length=1024, hop_length=160)
                f0 = f0[voiced]
                if len(f0) >= 20 and text[-1] in end_pitch:
                    end_pitch[text[-1]].append(12 * np.log2(np.median(f0[-15:]) / np.median(f0)))
        cells = "  ".join(f"'{mark}' {np.percentile(v, 25):+5.1f} / {np.percentile(v, 50):+5.1f} / {np.percentile(v, 75):+5.1f} "
                          f"(n={len(v)})" for mark, v in end_pitch.items() if v)
        print(f"{voice:>7}: {len(lead)} parts; lead {np.percentile(lead, 50):3.0f} / {np.percentile(lead, 95):3.0f} / "
              f"{max(lead):3.0f}  tail {np.percentile(tail, 50):3.0f} / {np.percentile(tail, 95):3.0f} / {max(tail):3.0f}  "
              f"flat tops {flat}  end pitch {cells}")


def complete_rates(name: str, bs: list, config: EndpointConfig) -> None:
    """How often the model says "complete": at the true end (its first question, at the pause; and
    any decision of the policy's before its timeout), and inside the pauses (first question; any
    decision before the user goes on: a cut-off)."""
    import turn_offline

    ends = [b for b in bs if b.is_end]
    pauses = [b for b in bs if not b.is_end]
    first = config.smart_pause_ms
    limit = config.smart_limit_ms + HANGOVER_MS
    decided = {id(b): turn_offline.decide(config, b, HANGOVER_MS, 80).at_ms for b in bs}

    def share(values) -> str:
        return f"{100 * np.mean(list(values)):5.1f}%"

    print(f"{name:>34}  {share(b.p[first] >= config.smart_threshold for b in ends)}"
          f"  {share(decided[id(b)] < limit for b in ends)} (n={len(ends):>3})"
          f"  {share(b.p[first] >= config.smart_threshold for b in pauses if first in b.p)}"
          f"  {share(decided[id(b)] is not None for b in pauses)} (n={len(pauses):>3})")


def replay(voices: list[str]) -> None:
    """The model's "complete" rates under the default policy; the curves are bench/turn_offline.py's
    (the same answers, from the same disk cache)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import turn_offline

    default = EndpointConfig()
    grid = turn_offline.asked_grid([c for family in turn_offline.families().values() for c in family]
                                   + list(turn_offline.MARKED.values()))
    model = SmartTurn()
    per_voice = {}
    for voice in voices:
        t0 = time.monotonic()
        per_voice[voice] = turn_offline.boundaries(render_all(turn_set(voice), voice=voice), model, HANGOVER_MS, grid)
        print(f"{voice}: {len(per_voice[voice])} boundaries, {sum(len(b.p) for b in per_voice[voice])} answers, "
              f"in {time.monotonic() - t0:.0f} s")
    model.close()
    print(f"\njudged complete (p >= {default.smart_threshold}) and decided by the default policy, answer 80 ms, "
          f"hangover {HANGOVER_MS} ms:")
    print(f"{'':>34}  {'true ends: at ' + str(default.smart_pause_ms) + ' ms':>16}  {'by the timeout':>14}"
          f"  {'pauses: at ' + str(default.smart_pause_ms) + ' ms':>14}  {'before speech resumes':>22}")
    shared = {b.turn for b in per_voice.get("espeak", []) if b.language == "en"}
    for voice, bs in per_voice.items():
        complete_rates(voice, bs, default)
        if voice != "espeak" and shared:  # the same English items in both voices: the voice's effect alone
            complete_rates(f"{voice}, espeak's English items", [b for b in bs if b.turn in shared], default)
    if shared:
        complete_rates("espeak, its English items", [b for b in per_voice["espeak"] if b.turn in shared], default)
    print(f"true ends the default policy leaves to its {default.smart_limit_ms} ms timeout (answer 80 ms):")
    for voice, bs in per_voice.items():
        late = [b.turn for b in bs if b.is_end
                and turn_offline.decide(default, b, HANGOVER_MS, 80).at_ms >= default.smart_limit_ms + HANGOVER_MS]
        print(f"{voice:>12}: {sum('paused' in t for t in late)} paused turns', {sum('complete' in t for t in late)} complete turns': "
              f"{' '.join(late)}")


BATCHES = (1, 2, 4, 8, 2, 1, 8)


def _session(arena: bool):
    """Smart Turn's ONNX session: the server's own (no arena), or the same options with the arena."""
    import onnxruntime

    if not arena:
        model = SmartTurn()
        model.close()  # its worker thread; the session stays usable
        return model._session
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(str(model_path()), sess_options=options, providers=["CPUExecutionProvider"])


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def memory_child(arena: bool) -> None:
    session = _session(arena)
    loaded = _rss_mb()
    held = []
    for batch in BATCHES:
        session.run(None, {"input_features": np.zeros((batch, 80, 800), np.float32)})
        held.append(f"{_rss_mb() - loaded:6.0f}")
    print(" ".join(held))


def memory() -> None:
    print("RSS held above the loaded model after each batch, MB (a fresh process each):")
    print(f"{'batch':>24} " + " ".join(f"{b:>6}" for b in BATCHES))
    for arena, name in ((True, "arena (onnxruntime's default)"), (False, "no arena (the server's)")):
        out = subprocess.run([sys.executable, __file__, "--memory-child", "on" if arena else "off"], capture_output=True,
                             text=True, check=True, timeout=600).stdout.strip()
        print(f"{name:>24} {out}")
    sessions = {arena: _session(arena) for arena in (True, False)}
    print("time per batch, ms (min of 3, interleaved), and per row:")
    for batch in (1, 2, 4, 8):
        features = np.zeros((batch, 80, 800), np.float32)
        times = {True: [], False: []}
        for _ in range(4):
            for arena, session in sessions.items():
                t0 = time.perf_counter()
                session.run(None, {"input_features": features})
                times[arena].append(time.perf_counter() - t0)
        on, off = min(times[True][1:]) * 1000, min(times[False][1:]) * 1000
        print(f"  batch {batch}: arena {on:6.0f} ({on / batch:4.0f} a row)   no arena {off:6.0f} ({off / batch:4.0f} a row)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--replay", action="store_true", help="only the replay (section 3), for each of --voices")
    parser.add_argument("--parts", action="store_true", help="only the parts' check (section 5), for each of --voices")
    parser.add_argument("--voices", nargs="+", choices=VOICES, default=list(VOICES),
                        help="tests/turn_set.py's voices for --replay and --parts (piper: pip install '.[bench]')")
    parser.add_argument("--memory", action="store_true", help="only the memory a batch leaves held (section 4)")
    parser.add_argument("--memory-child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child == "on")
        return
    if args.memory:
        memory()
        return
    if args.replay:
        replay(args.voices)
        return
    if args.parts:
        part_checks(args.voices)
        return
    if not args.skip_speed:
        speed(args.calls)
    trailing_silence()
    for early_ms in (32, 64):
        padded_tail(early_ms)


if __name__ == "__main__":
    main()
