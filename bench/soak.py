"""An accelerated soak: many sessions for as long as you like, with a report every minute.

    python bench/soak.py [--sessions 20] [--minutes 60] [--report-s 60] [--reset-s 5] [--config FILE]
    python bench/soak.py --short        # ~30 s, 6 sessions, a report every 10 s (tests/integration/test_soak.py)

Starts the server as a subprocess (run_server.py with a temporary copy of the config, a phrase
grammar for the test sentences and the periodic reset every `--reset-s`), then runs `--sessions`
clients on 127.0.0.1, each in a role, round robin:

- talker: speaks a real espeak sentence in real time, waits for the whole reply, pauses, again;
- barger: asks for a long `say`, talks over it (barge-in), checks `audio.interrupted`;
- reconnector: talks a turn, vanishes mid-reply (no close), reconnects with `resume`;
- slow reader: a talker that reads its socket slower than real time (200 ms frames every 300 ms);
- and one idle socket (a started session that never speaks) and one fuzzing client (the hostile
  frames of tests/hostile.py, random bytes, then a `ping` that must be answered).

Every report prints the server process's RSS (the mean of a reading every second since the last
report), open file descriptors, threads, asyncio tasks,
event-loop lag (from /metrics: mean, p99 and max, and the stalls over 100 ms by what held the loop:
gc/gil/callback, voicebot/loop_watch.py; the summary adds the server's GC collections by
generation, with their mean pause), first-audio p50/p95 of the replies that ended in the interval
(`audio.end` timings), reply frames promised (`audio.end.frames` + `audio.interrupted.frames_sent`)
against frames received, lost audio (frames promised and never received, plus the server's
`frames_dropped{overload}` and dropped input) and session deaths without an error event (a socket
the server closed without a documented code after an `error`, a ping never answered, a reply or
transcript that never came). Both must stay 0; the exit status is 1 if either is not, if the
server died or logged a traceback. Queue depths (the VAD batcher's, the device scheduler's) and
the busiest engine pool's load are sampled at each report. At the end, RSS by 10-minute block
(`--block-min`) against the first block after the warm-up (`--warmup-min`): memory drift is judged
on those means. The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import websockets
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.conftest import TEST_PHRASES, free_port, speech_pcm  # noqa: E402
from tests.hostile import HOSTILE_TEXT  # noqa: E402
from voicebot.protocol import CloseCode, ErrorCode  # noqa: E402

RSS_SAMPLE_S = 1.0
ROLES = ("talker", "barger", "reconnector", "slow_reader")
# Closes that follow an `error` event and are documented (docs/protocol.md).
DOCUMENTED_CLOSES = {CloseCode.FLOODING, CloseCode.TRY_AGAIN_LATER, CloseCode.GOING_AWAY}
LONG_SAY = " ".join(["This is a long announcement for the show, read slowly so that someone can talk over it."] * 3)
EVENT_TIMEOUT_S = 60  # no single wait of a client lasts longer


@dataclass
class Tally:
    """What the clients saw; the reporter reads and resets the interval fields."""

    first_audio_ms: list[float] = field(default_factory=list)  # this interval
    # Of every reply that ended (audio.end) or was cut (audio.interrupted): the frames the event
    # says were sent, and the frames that came before it (the socket keeps them in order).
    frames_promised: int = 0
    frames_received: int = 0
    replies: int = 0
    interrupted: int = 0
    utterances_sent: int = 0
    utterances_heard: int = 0  # asr.final, or an error event for the utterance
    resumed: int = 0
    reconnects: int = 0
    deaths: list[str] = field(default_factory=list)  # a session that died without an error event
    fuzz_messages: int = 0
    idle_closes: int = 0  # the idle socket closed by the server's idle timeout, as it must be
    started: float = field(default_factory=time.monotonic)


class Client:
    """One WebSocket session that records its events and its reply frames."""

    def __init__(self, url: str, tally: Tally, read_delay_s: float = 0.0) -> None:
        self.url, self.tally, self.read_delay_s = url, tally, read_delay_s
        self.events: list[dict] = []
        self.reply_frames: dict[str, int] = {}
        self._reply: str | None = None
        self._new = asyncio.Event()
        self.ws = None

    async def __aenter__(self) -> "Client":
        self.ws = await websockets.connect(self.url, max_size=None, open_timeout=EVENT_TIMEOUT_S)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        self._reader.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 5)

    def vanish(self) -> None:
        """Drop the connection without a closing handshake (a client that crashed, a lost network)."""
        self._reader.cancel()
        self.ws.transport.abort()

    async def _read(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in self.ws:
                if self.read_delay_s:
                    await asyncio.sleep(self.read_delay_s)
                if isinstance(message, bytes):
                    self.reply_frames[self._reply] = self.reply_frames.get(self._reply, 0) + 1
                else:
                    self._on_event(json.loads(message))
                self._new.set()
        self._new.set()  # a waiter learns that the socket closed

    def _on_event(self, event: dict) -> None:
        self.events.append(event)
        kind = event["type"]
        if kind == "audio.start":
            self._reply = event["reply_id"]
        elif kind == "audio.end":
            self._settle(event["reply_id"], event["frames"])
            self.tally.replies += 1
            if event["timings"]["first_audio_ms"] is not None:
                self.tally.first_audio_ms.append(event["timings"]["first_audio_ms"])
        elif kind == "audio.interrupted":
            self._settle(event["reply_id"], event["frames_sent"])
            self.tally.interrupted += 1
        elif kind == "asr.final":
            self.tally.utterances_heard += 1

    def _settle(self, reply_id: str, frames_sent: int) -> None:
        self.tally.frames_promised += frames_sent
        self.tally.frames_received += self.reply_frames.pop(reply_id, 0)

    async def send(self, message: dict | str | bytes) -> None:
        await self.ws.send(json.dumps(message) if isinstance(message, dict) else message)

    async def wait_for(self, kind: str, after: int = 0, timeout: float = EVENT_TIMEOUT_S, **match) -> dict:
        """The first event of `kind` (with these fields) at index >= after."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events[after:]:
                if event["type"] == kind and all(event.get(k) == v for k, v in match.items()):
                    return event
            if self._reader.done():
                raise ConnectionError(f"socket closed ({self.ws.close_code}) while waiting for {kind}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind} within {timeout} s")
            self._new.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._new.wait(), deadline - time.monotonic())

    async def start(self, **fields) -> dict:
        await self.send({"type": "session.start", **fields})
        return await self.wait_for("session.ready")

    async def speak(self, text: str) -> None:
        pcm = speech_pcm(text, lead_s=0.3, tail_s=1.0)
        step = 3200  # 100 ms at 16 kHz
        for i in range(0, len(pcm), step):
            await self.ws.send(pcm[i : i + step])
            await asyncio.sleep(0.1)
        self.tally.utterances_sent += 1

    async def turn(self, text: str) -> None:
        """Say `text`; wait for its transcript and, if it has words, the whole reply."""
        after = len(self.events)
        await self.speak(text)
        final = await self.wait_for("asr.final", after)
        if final["text"].strip():
            await self.wait_for("audio.end", after)

    def died(self, why: str) -> None:
        """Record a session death unless the server explained it: an error event, then a documented close."""
        code = self.ws.close_code if self.ws else None
        errors = [e for e in self.events if e["type"] == "error"]
        if not (code in DOCUMENTED_CLOSES and errors):
            death = f"{why} (close {code}, last events {[e['type'] for e in self.events[-3:]]})"
            self.tally.deaths.append(death)
            print(f"death at {time.monotonic() - self.tally.started:.0f} s: {death}", flush=True)  # as it happens: a soak runs for hours


async def talker(url: str, tally: Tally, deadline: float, index: int, read_delay_s: float = 0.0) -> None:
    rng = random.Random(index)
    while time.monotonic() < deadline:
        async with Client(url, tally, read_delay_s) as client:
            try:
                await client.start()
                while time.monotonic() < deadline:
                    await client.turn(TEST_PHRASES[rng.randrange(len(TEST_PHRASES))])
                    await asyncio.sleep(rng.uniform(0.5, 2.0))
            except (ConnectionError, TimeoutError, websockets.ConnectionClosed) as exc:
                client.died(f"talker {index}: {exc}")


async def barger(url: str, tally: Tally, deadline: float, index: int) -> None:
    rng = random.Random(index)
    while time.monotonic() < deadline:
        async with Client(url, tally) as client:
            try:
                await client.start()
                while time.monotonic() < deadline:
                    after = len(client.events)
                    await client.send({"type": "say", "text": LONG_SAY})
                    await client.wait_for("audio.start", after)
                    await asyncio.sleep(rng.uniform(0.5, 1.5))
                    await client.turn(TEST_PHRASES[rng.randrange(len(TEST_PHRASES))])  # talks over it
                    await client.wait_for("audio.interrupted", after, reason="barge_in")
                    await asyncio.sleep(rng.uniform(0.5, 2.0))
            except (ConnectionError, TimeoutError, websockets.ConnectionClosed) as exc:
                client.died(f"barger {index}: {exc}")


async def reconnector(url: str, tally: Tally, deadline: float, index: int) -> None:
    rng = random.Random(index)
    resume = None
    while time.monotonic() < deadline:
        client = Client(url, tally)
        async with client:
            try:
                ready = await client.start(**({"resume": resume} if resume else {}))
                tally.reconnects += resume is not None
                tally.resumed += bool(ready.get("resumed"))
                resume = ready["resume_token"]
                after = len(client.events)
                await client.speak(TEST_PHRASES[rng.randrange(len(TEST_PHRASES))])
                if (await client.wait_for("asr.final", after))["text"].strip():
                    await client.wait_for("audio.start", after)
                await asyncio.sleep(rng.uniform(0, 0.6))
                client.vanish()  # mid-reply: the server must clean up and keep the conversation
            except (ConnectionError, TimeoutError, websockets.ConnectionClosed) as exc:
                client.died(f"reconnector {index}: {exc}")
        await asyncio.sleep(rng.uniform(0.2, 1.0))


async def idle_socket(url: str, tally: Tally, deadline: float) -> None:
    """A started session that never speaks (the client answers the server's WebSocket pings): the
    server must close it after server.idle_timeout_s with an `idle_timeout` error; it comes back."""
    while time.monotonic() < deadline:
        async with Client(url, tally) as client:
            try:
                await client.start()
                while time.monotonic() < deadline and not client._reader.done():
                    await asyncio.sleep(1)
                if client._reader.done():
                    errors = [e.get("code") for e in client.events if e["type"] == "error"]
                    if client.ws.close_code == CloseCode.POLICY and errors[-1:] == [ErrorCode.IDLE_TIMEOUT]:
                        tally.idle_closes += 1
                    else:
                        client.died("idle socket closed by the server without idle_timeout")
            except (ConnectionError, TimeoutError, websockets.ConnectionClosed) as exc:
                client.died(f"idle socket: {exc}")


async def fuzzer(url: str, tally: Tally, deadline: float) -> None:
    rng = random.Random(12)
    while time.monotonic() < deadline:
        async with Client(url, tally) as client:
            try:
                if rng.random() < 0.8:
                    await client.start()
                for _ in range(rng.randint(1, 20)):
                    choice = rng.random()
                    if choice < 0.5:
                        await client.send(rng.choice(HOSTILE_TEXT))
                    elif choice < 0.8:
                        await client.send(rng.randbytes(rng.randint(0, 4000)))
                    else:
                        await client.send(json.dumps({"type": rng.choice(["say", "ping", "session.update", "dance"]),
                                                      "text": rng.choice(["", "hi", 5]), "id": rng.randint(-9, 9)}))
                    tally.fuzz_messages += 1
                after = len(client.events)
                await client.send({"type": "ping", "id": "alive"})
                await client.wait_for("pong", after, timeout=20, id="alive")
            except (ConnectionError, TimeoutError, websockets.ConnectionClosed) as exc:
                client.died(f"fuzzer: {exc}")
        await asyncio.sleep(rng.uniform(0.1, 1.0))


class ServerProbe:
    """The server process seen from outside: /proc and /metrics."""

    def __init__(self, pid: int, base: str) -> None:
        self.pid, self.base = pid, base
        self._lag_before: dict[str, float] = {}
        # RSS read every RSS_SAMPLE_S between reports (one float each: 3,600 an hour), because one
        # reading a minute lands on whatever is in flight at that instant (a reply's buffers, a
        # decoder being built) and swings ±10 % with the load; a mean over the interval does not.
        self.rss_samples: list[float] = []

    def _status(self) -> dict[str, str]:
        return dict(line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines() if ":" in line)

    def rss_mb(self) -> float:
        return int(self._status()["VmRSS"].split()[0]) / 1024

    async def sample_rss(self, until: float) -> None:
        while time.monotonic() < until:
            with contextlib.suppress(OSError, KeyError):  # the server gone: the report says so
                self.rss_samples.append(self.rss_mb())
            await asyncio.sleep(RSS_SAMPLE_S)

    def proc(self) -> dict:
        """The process now, and its RSS over the samples since the last call."""
        status = self._status()
        samples, self.rss_samples = self.rss_samples or [int(status["VmRSS"].split()[0]) / 1024], []
        return {"rss_mb": float(np.mean(samples)), "rss_min_mb": min(samples), "rss_max_mb": max(samples),
                "rss_samples": len(samples), "threads": int(status["Threads"]), "fds": len(os.listdir(f"/proc/{self.pid}/fd"))}

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
                samples[key] = s.value
        return samples

    def lag_ms(self, m: dict[str, float]) -> dict[str, float]:
        """Over the interval since the last call: the mean loop lag, its p99 and its max (each the
        upper bound of the histogram bucket it fell in), and the stalls by cause (voicebot/loop_watch.py)."""
        counters = {k: v for k, v in m.items() if k.startswith(("voicebot_event_loop_lag_seconds_", "voicebot_event_loop_stalls_total"))}
        before, self._lag_before = self._lag_before, counters
        delta = {k: v - before.get(k, 0.0) for k, v in counters.items()}
        stalls = {cause: int(delta.get(f"voicebot_event_loop_stalls_total{{cause={cause}}}", 0)) for cause in ("gc", "gil", "callback")}
        count = delta.get("voicebot_event_loop_lag_seconds_count", 0.0)
        if not count:
            return {"lag_ms": 0.0, "lag_p99_ms": 0.0, "lag_max_ms": 0.0, "stalls": stalls}
        bounds = sorted((float(k.split("le=")[1].rstrip("}")), v) for k, v in delta.items() if "_bucket" in k)
        p99 = next(le for le, v in bounds if v >= 0.99 * count)
        slowest = next(le for le, v in bounds if v >= count)  # the +Inf bucket holds all of them
        return {"lag_ms": round(1000 * delta["voicebot_event_loop_lag_seconds_sum"] / count, 2), "lag_p99_ms": 1000 * p99,
                "lag_max_ms": 1000 * slowest, "stalls": stalls}


def _stalls(by_cause: dict[str, int]) -> str:
    """gc/gil/callback counts, as one column."""
    return "/".join(str(by_cause[c]) for c in ("gc", "gil", "callback"))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def run(url: str, probe: ServerProbe, process: subprocess.Popen, args) -> dict:
    tally = Tally()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    roles = {"talker": talker, "barger": barger, "reconnector": reconnector,
             "slow_reader": lambda *a: talker(*a, read_delay_s=0.3)}  # 200 ms frames read every 300 ms
    clients = [roles[ROLES[i % len(ROLES)]](url, tally, deadline, i) for i in range(args.sessions)]
    tasks = [asyncio.create_task(c) for c in (*clients, idle_socket(url, tally, deadline), fuzzer(url, tally, deadline),
                                              probe.sample_rss(deadline))]
    print(f"{args.sessions} sessions ({', '.join(ROLES)} in turn) + an idle socket + a fuzzing client; "
          f"reset every {args.reset_s:g} s; a report every {args.report_s:g} s")
    print(f"{'min':>5} {'RSS MB':>7} {'fds':>5} {'thr':>4} {'tasks':>6} {'lag ms':>7} {'lag p99':>7} {'lag max':>7} {'stalls':>11} {'replies':>7} {'cut':>4} "
          f"{'1st p50':>7} {'p95':>6} {'promised':>9} {'received':>9} {'lost':>5} {'deaths':>6} {'resumed':>8} {'fuzz':>6} {'vadq':>4} {'schq':>4} {'load':>5}", flush=True)
    rows, metrics = [], {}
    # Ctrl-C ends an hours-long soak early with its table and summary, as its deadline would.
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    while (now := time.monotonic()) < deadline and process.poll() is None and not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), min(args.report_s, deadline - now))
        if process.poll() is None:
            metrics = await asyncio.to_thread(probe.metrics)  # off the clients' loop
            rows.append(report(probe, metrics, tally, start))
    if stop.is_set():
        print(f"stopped early (SIGINT) at minute {(time.monotonic() - start) / 60:.1f}")
    for task in tasks:  # a turn in progress at the deadline is cut: its reply is not counted
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if process.poll() is not None:
        tally.deaths.append(f"the server exited with {process.returncode}")
    for death in tally.deaths[:20]:
        print("death:", death)
    lost = rows[-1]["lost"] if rows else 0
    blocks = rss_blocks(rows, args.block_min, args.warmup_min)
    if blocks:
        print(f"RSS by {args.block_min:g}-minute block (mean of the {RSS_SAMPLE_S:g} s samples; drift against the first "
              f"block after {args.warmup_min:g} min of warm-up):")
        for b in blocks:
            print(f"  {b['from']:>5g}-{b['to']:<5g} mean {b['mean_mb']:7.1f} MB  min {b['min_mb']:7.1f}  "
                  f"max {b['max_mb']:7.1f}  drift {b['drift_pct']:+6.2f} %", flush=True)
    drifts = [abs(b["drift_pct"]) for b in blocks if not b["warmup"]]
    return {"minutes": round((time.monotonic() - start) / 60, 2), "sessions": args.sessions, "replies": tally.replies, "interrupted": tally.interrupted,
            "frames_promised": tally.frames_promised, "frames_received": tally.frames_received, "lost_frames": lost,
            "deaths": len(tally.deaths), "utterances_sent": tally.utterances_sent, "asr_finals": tally.utterances_heard,
            "resumed": tally.resumed, "reconnects": tally.reconnects, "fuzz_messages": tally.fuzz_messages,
            "idle_closes": tally.idle_closes,
            "lag_ms_mean": round(float(np.mean([r["lag_ms"] for r in rows])), 2) if rows else None,
            "lag_p99_ms_worst": max((r["lag_p99_ms"] for r in rows), default=None),
            "lag_max_ms": max((r["lag_max_ms"] for r in rows), default=None),
            "stalls": {c: sum(r["stalls"][c] for r in rows) for c in ("gc", "gil", "callback")},
            "gc_pauses": gc_pauses(metrics),
            "rss_mb_first": rows[0]["rss_mb"] if rows else None, "rss_mb_last": rows[-1]["rss_mb"] if rows else None,
            "rss_blocks": blocks, "rss_max_block_drift_pct": round(max(drifts), 2) if drifts else None,
            "server_alive": process.poll() is None, "rows": rows}


def gc_pauses(m: dict[str, float]) -> dict[str, dict[str, float]]:
    """The server's cyclic GC collections since start-up, by generation: how many, their mean."""
    pauses = {}
    for generation in "012":
        count = m.get(f"voicebot_gc_pause_seconds_count{{generation={generation}}}", 0.0)
        total = m.get(f"voicebot_gc_pause_seconds_sum{{generation={generation}}}", 0.0)
        pauses[generation] = {"count": int(count), "mean_ms": round(1000 * total / count, 2) if count else None}
    return pauses


def rss_blocks(rows: list[dict], block_min: float, warmup_min: float) -> list[dict]:
    """The reports' RSS means grouped into blocks of `block_min` minutes, each weighted by its
    samples; drift is each block's mean against the first block that starts after the warm-up."""
    grouped: dict[int, list[dict]] = {}
    for row in rows:
        grouped.setdefault(int((row["min"] - 1e-6) // block_min), []).append(row)
    blocks = []
    for index, members in sorted(grouped.items()):
        weights = [r["rss_samples"] for r in members]
        blocks.append({"from": index * block_min, "to": index * block_min + block_min, "warmup": index * block_min < warmup_min,
                       "mean_mb": round(float(np.average([r["rss_mb"] for r in members], weights=weights)), 1),
                       "min_mb": min(r["rss_min_mb"] for r in members), "max_mb": max(r["rss_max_mb"] for r in members)})
    reference = next((b["mean_mb"] for b in blocks if not b["warmup"]), None)
    for b in blocks:
        b["drift_pct"] = round((b["mean_mb"] - reference) / reference * 100, 2) if reference else 0.0
    return blocks


# voicebot_input_dropped_seconds_total reasons that are an error sent to the client (protocol.check_audio).
REFUSED_AS_MALFORMED = ("frame_too_large", "odd_pcm_bytes")


def report(probe: ServerProbe, m: dict[str, float], tally: Tally, start: float) -> dict:
    """One row: the server process, its metrics `m`, and what the clients saw since the last row."""
    lag = probe.lag_ms(m)
    # Input refused as malformed (the fuzzing client's frames) was answered with that error: told, not lost.
    server_lost = m.get("voicebot_frames_dropped_total{reason=overload}", 0) + sum(
        v for k, v in m.items() if k.startswith("voicebot_input_dropped_seconds_total") and not any(
            f"reason={code}" in k for code in REFUSED_AS_MALFORMED))
    row = {"min": round((time.monotonic() - start) / 60, 2), **probe.proc(), "tasks": m.get("voicebot_asyncio_tasks", 0),
           **lag, "replies": tally.replies, "interrupted": tally.interrupted,
           "first_audio_p50": pct(tally.first_audio_ms, 50), "first_audio_p95": pct(tally.first_audio_ms, 95),
           "promised": tally.frames_promised, "received": tally.frames_received,
           "lost": tally.frames_promised - tally.frames_received + server_lost,
           "deaths": len(tally.deaths), "resumed": f"{tally.resumed}/{tally.reconnects}", "fuzz": tally.fuzz_messages,
           # Sampled at the report: streams waiting for the VAD batcher, requests waiting for the
           # device scheduler (CosyVoice 2 configs), and the busiest engine pool's share of its time.
           "vad_queue": m.get("voicebot_vad_queue_depth", 0), "scheduler_queue": m.get("voicebot_scheduler_queue_depth", 0),
           "pool_load": max((v for k, v in m.items() if k.startswith("voicebot_worker_load")), default=0.0)}
    tally.first_audio_ms = []
    print(f"{row['min']:>5.1f} {row['rss_mb']:>7.0f} {row['fds']:>5} {row['threads']:>4} {row['tasks']:>6.0f} "
          f"{row['lag_ms']:>7.2f} {row['lag_p99_ms']:>7.0f} {row['lag_max_ms']:>7.0f} {_stalls(row['stalls']):>11} {row['replies']:>7} {row['interrupted']:>4} "
          f"{row['first_audio_p50']:>7.0f} {row['first_audio_p95']:>6.0f} {row['promised']:>9} {row['received']:>9} "
          f"{row['lost']:>5.0f} {row['deaths']:>6} {row['resumed']:>8} {row['fuzz']:>6} "
          f"{row['vad_queue']:>4.0f} {row['scheduler_queue']:>4.0f} {row['pool_load']:>5.2f}", flush=True)
    return row


def main() -> int:
    # A soak stopped with SIGTERM (kill, a CI timeout) must stop its server too: exit through the
    # `finally` below instead of dying at once and leaving the server running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--report-s", type=float, default=60)
    parser.add_argument("--reset-s", type=float, default=5)
    parser.add_argument("--block-min", type=float, default=10, help="RSS drift is judged on means over blocks this long")
    parser.add_argument("--warmup-min", type=float, default=10, help="blocks starting before this are warm-up")
    parser.add_argument("--short", action="store_true", help="~30 s, 6 sessions, a report every 10 s (for CI)")
    parser.add_argument("--server-log", type=Path, help="keep the server's output in this file (default: a temporary one)")
    args = parser.parse_args()
    if args.short:
        args.sessions, args.minutes, args.report_s, args.block_min, args.warmup_min = 6, 0.5, 10, 0.25, 0.25

    config = yaml.safe_load(Path(args.config).read_text()) or {}
    port = free_port()
    # Room for every client, the idle socket, the fuzzer and reconnects not yet seen as closed.
    config.setdefault("server", {}).update({"port": port, "max_sessions": args.sessions + 8})
    config.setdefault("reset", {})["interval_s"] = args.reset_s
    config["log_level"] = "warning"
    if config.get("asr", {}).get("engine", "pocketsphinx") == "pocketsphinx":
        pocketsphinx = config.setdefault("asr", {}).setdefault("pocketsphinx", {})
        pocketsphinx["phrases"] = TEST_PHRASES
        # All the soak's streams (its sessions, the idle socket, the fuzzer) connect at once: a decoder
        # waiting for each, as an operator expecting such bursts would configure.
        pocketsphinx.setdefault("decoders", args.sessions + 2)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "soak.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log = open(args.server_log or Path(tmp) / "server.log", "w+")
        process = subprocess.Popen([sys.executable, str(ROOT / "run_server.py"), "--config", str(config_path)], cwd=ROOT,
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            base = f"http://127.0.0.1:{port}"
            for _ in range(1200):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                        break
                if process.poll() is not None:
                    break
                time.sleep(0.1)
            else:
                raise SystemExit("the server did not become ready in 120 s")
            summary = asyncio.run(run(f"ws://127.0.0.1:{port}/v1/voice", ServerProbe(process.pid, base), process, args))
        finally:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)
            log.seek(0)
            crashes = [line for line in log.read().splitlines() if "Traceback" in line or "Exception in ASGI" in line]
            log.close()
        summary["server_tracebacks"] = len(crashes)
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    ok = summary["lost_frames"] == 0 and summary["deaths"] == 0 and summary["server_alive"] and not crashes
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
