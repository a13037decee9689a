"""What the noise gate holds back from the endpointer when an utterance ends, on tests/turn_set.py.

    python bench/gate_hold.py [--chunk-ms 40]

Each turn (1 s of room before it, 1 s after) streams in chunks through the gate
(voicebot/audio/gate.py) into the endpointer (voicebot/audio/endpoint.py, Silero, the silence
rule), as a session's front end does. At each endpoint, the input that had to arrive after the
window that decided it before the endpointer could hear that window: the gate's hold plus the
wait for the chunk. Side by side, from the same run: the gate as it is (a block leaves once no
mute can reach it) and a gate that holds every block for its whole lookahead (the old one, whose
output was the same samples, each `lookahead` blocks later: its figure follows from the decided
sample's position alone). Also the hold over every chunk. Rooms: digital silence, white noise at
-60 and -50 dBFS (bench/turn_offline.py's).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.turn_set import SAMPLE_RATE, TURNS, render_all  # noqa: E402
from voicebot.audio.endpoint import Endpointer, EventKind  # noqa: E402
from voicebot.audio.gate import NoiseGate  # noqa: E402
from voicebot.config.stages import EndpointConfig, GateConfig  # noqa: E402

NOISE_DBFS = (None, -60, -50)


def replay(audio: np.ndarray, chunk: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(decided sample, input fed when the endpointer heard it) per endpoint; the gate's hold per chunk."""
    gate, endpointer = NoiseGate(GateConfig(), SAMPLE_RATE), Endpointer(EndpointConfig())
    ends, holds, fed, out = [], [], 0, 0
    for start in range(0, len(audio), chunk):
        piece = audio[start : start + chunk]
        gated = gate.process(piece)
        fed, out = fed + len(piece), out + len(gated)
        holds.append(fed - out)
        # Each window is judged in turn: an END's window is the last one seen when it is returned.
        for window in endpointer.cut(gated):
            events = endpointer.decide(window[None], endpointer.vad.probabilities(window[None]))
            if any(event.kind is EventKind.END for event in events):
                ends.append((endpointer.samples_seen, fed))
    return ends, holds


def held_for_lookahead(decided: int, gate: NoiseGate, chunk: int) -> int:
    """Input fed, at a chunk's end, once a gate holding every block `lookahead` blocks has let
    `decided` samples out (after fed samples it has let out (fed // block - lookahead) blocks)."""
    fed = (math.ceil(decided / gate.block) + gate.lookahead) * gate.block
    return math.ceil(fed / chunk) * chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-ms", type=int, default=40, help="the mic page's chunk")
    args = parser.parse_args()
    chunk = SAMPLE_RATE * args.chunk_ms // 1000
    reference_gate = NoiseGate(GateConfig(), SAMPLE_RATE)
    rendered = render_all(TURNS)
    ms = 1000 / SAMPLE_RATE
    print(f"{len(rendered)} turns, {args.chunk_ms} ms chunks; input arrived after an endpoint's deciding window"
          " when the endpointer heard it, ms (p50 / p95 / max)")
    print(f"{'room':>10} {'endpoints':>9} {'gate releases':>22} {'whole lookahead':>22} {'saved mean':>10}"
          f" {'hold over all chunks p50 / p95':>31}")
    for noise in NOISE_DBFS:
        rng = np.random.default_rng(0)
        now, before, holds = [], [], []
        for turn in rendered:
            lead = np.zeros(SAMPLE_RATE, np.float32)
            audio = np.concatenate([lead, turn.audio, lead])
            if noise is not None:
                audio = audio + rng.standard_normal(len(audio)).astype(np.float32) * 10 ** (noise / 20)
            ends, chunk_holds = replay(audio, chunk)
            holds += chunk_holds
            for decided, fed in ends:
                now.append((fed - decided) * ms)
                before.append((held_for_lookahead(decided, reference_gate, chunk) - decided) * ms)
        now_a, before_a, holds_a = np.array(now), np.array(before), np.array(holds) * ms
        room = "silence" if noise is None else f"{noise} dBFS"
        figures = [f"{np.percentile(a, 50):6.1f} / {np.percentile(a, 95):5.1f} / {a.max():5.1f}" for a in (now_a, before_a)]
        print(f"{room:>10} {len(now_a):>9} {figures[0]:>22} {figures[1]:>22} {np.mean(before_a - now_a):>10.1f}"
              f" {np.percentile(holds_a, 50):>20.1f} / {np.percentile(holds_a, 95):5.1f}")


if __name__ == "__main__":
    main()
