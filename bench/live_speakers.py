"""Live speakers at once: who is admitted, how long each waits for a reply, how far behind its input runs.

    python bench/live_speakers.py [--config configs/default.yaml] [--clients 1 2 4 8 16 24]
                                  [--voice espeak|piper] [--lm] [--ref DIR]

N clients connect to one server (a subprocess on 127.0.0.1, the given config) over real WebSockets,
a few ms apart as people joining a show do, and each says 2 complete English turns of
tests/turn_set.py (espeak by default; `--voice piper`, the Piper voice, with the bench extra) as a
live microphone: 20 ms chunks on the wall clock, silence between and after, the reply interrupted
once its first frame is in (as bench/latency.py does). Printed per N:
- admitted / refused (refused: the `busy` error's reason and retry_after_s);
- end of speech to the first reply frame, p50 / p95 over every admitted client's turns, at the
  client (the moment the turn's last sample was spoken to the frame's arrival);
- input lag p50 / p95: how far behind the wall clock the server processed the input. From the
  server's voicebot_input_lag_seconds histogram where it has one (`server`), and, for every server,
  from asr.final's timings (`client`: endpoint_delay_ms less the pause the endpointer waits for,
  endpoint.smart_pause_ms or endpoint_silence_ms: the wall time from the end of speech to the
  endpoint beyond the audio it had to hear, so the input path's lag, plus up to a VAD window);
- server CPU per live speaker (main process and its decoding children apart), in cores, over the
  time the clients spoke;
- after each N, the admission's view of each pool (/readyz `capacity`): its load as fixed +
  marginal x sessions, as learnt so far;
- the input path's CPU per session per second of audio (µs): the server's
  voicebot_input_cpu_seconds_total over voicebot_input_audio_seconds_total where it has them, and
  the whole server's CPU over the audio every admitted client sent (an upper bound: replies too).

`--ref DIR` runs the same on another checkout (say `git -C /work/main archive 77c2663 | tar -x -C
/tmp/ref77`) right after, and prints both side by side with the ratios. pocketsphinx decodes with
a grammar of the set's phrases, as bench/latency.py does (its general English model costs half a
core per speaking stream, bench/pocketsphinx_burst.py: its backlog, not the input path, would be
measured); `--lm` keeps the config's own model.

Every figure is measured on whatever else the machine is doing: on a shared box, an upper bound.
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
import yaml

ROOT = Path(__file__).resolve().parent.parent
import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from bench.latency import Client, TurnResult, grammar, pct, speak  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.turn_set import RenderedTurn, render_all, turn_set  # noqa: E402
from voicebot.config import load_settings  # noqa: E402

RATE = 16000
CHUNK_S = 0.02  # a live microphone's 20 ms
TURNS = 2
CONNECT_SPREAD_S = 0.05  # between two clients' connects
GAP_S = 0.5  # silence between a client's turns
TICKS = os.sysconf("SC_CLK_TCK")
DISTINCT_TURNS = 8  # rendered (espeak-ng takes a while on a loaded box), cycled over the clients


class LiveClient(Client):
    """bench/latency.py's client with a live microphone's 20 ms chunks."""

    async def send_audio(self, pcm: bytes) -> None:
        step = int(RATE * CHUNK_S) * 2
        for i in range(0, len(pcm), step):
            self.clock += CHUNK_S
            await asyncio.sleep(max(0.0, self.clock - time.monotonic()))
            await self.ws.send(pcm[i : i + step])


@dataclass
class ClientRun:
    admitted: bool
    refusal: dict | None = None  # the busy error
    results: list[TurnResult] = field(default_factory=list)
    audio_s: float = 0.0  # sent


async def live_client(url: str, turns, delay_s: float) -> ClientRun:
    import websockets

    await asyncio.sleep(delay_s)
    async with websockets.connect(url, max_size=None, ping_interval=None) as ws:
        with contextlib.suppress(websockets.ConnectionClosed):  # refused: the error came first, then the close
            await ws.send(json.dumps({"type": "session.start", "sample_rate": RATE}))
        first = json.loads(await ws.recv())
        if first["type"] == "error":
            return ClientRun(False, first)
        client = LiveClient(ws)
        run = ClientRun(True)
        began = time.monotonic()
        for turn in turns:
            run.results.append(await speak(client, turn))
            await client.silence_until(lambda: False, GAP_S)
        run.audio_s = time.monotonic() - began
        client._reader.cancel()
        return run


def cpu_s(pid: int) -> tuple[float, float]:
    """(the process's own CPU seconds, its live children's), from /proc."""
    def of(p: int) -> float:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / TICKS
        return 0.0

    children = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            children.update(int(c) for c in (task / "children").read_text().split())
    return of(pid), sum(of(c) for c in children)


def metric_samples(text: str, name: str) -> dict[tuple, float]:
    """{(sample name, labels string): value} of one metric family in a Prometheus exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def histogram_quantile(before: dict, after: dict, name: str, q: float) -> float | None:
    """The q-quantile of what a histogram observed between two scrapes (all labels summed), linear
    within a bucket, as Prometheus's histogram_quantile does."""
    buckets: dict[float, float] = {}
    for key, value in after.items():
        if key.startswith(name + "_bucket"):
            le = re.search(r'le="([^"]+)"', key).group(1)
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + value - before.get(key, 0.0)
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    target, lower, below = q * buckets[bounds[-1]], 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= target:
            if bound == float("inf"):
                return lower
            share = (target - below) / max(buckets[bound] - below, 1e-9)
            return lower + (bound - lower) * share
        lower, below = bound, buckets[bound]
    return None


def total(samples: dict, name: str) -> float:
    return sum(v for k, v in samples.items() if k.split("{")[0] == name)


def start_server(root: Path, config: dict) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    config = {**config, "server": {**config.get("server", {}), "port": port}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    log = open(Path(tempfile.gettempdir()) / f"voicebot-live-{port}.log", "w")  # the server's own log, for a failed run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    server = subprocess.Popen([sys.executable, str(root / "run_server.py"), "--config", f.name], cwd=root,
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    for _ in range(900):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                break
        time.sleep(0.1)
    else:
        server.kill()
        raise RuntimeError(f"the server in {root} did not get ready (log: {log.name})")
    return server, base, f.name


@dataclass
class Row:
    n: int
    runs: list[ClientRun]
    cpu_main: float  # cores per admitted speaker
    cpu_children: float
    lag_server: tuple[float | None, float | None]
    input_us: float | None  # the server's input path, µs per session per s of audio
    whole_us: float  # the whole server's CPU, µs per session per s of audio
    endpoint_pause_ms: float  # what the endpointer waits for before it ends a segment

    @property
    def admitted(self) -> list[ClientRun]:
        return [r for r in self.runs if r.admitted]

    def latencies(self) -> list[float]:
        return [t.first_audio_ms for r in self.admitted for t in r.results if t.first_audio_ms is not None]

    def client_lag(self) -> list[float]:
        return [t.asr_timings["endpoint_delay_ms"] - self.endpoint_pause_ms for r in self.admitted for t in r.results
                if "endpoint_delay_ms" in t.asr_timings]

    def fates(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.admitted:
            for t in r.results:
                if t.fate is not None:
                    key = re.sub(r"\[.*|'.*", "", t.fate)[:60]
                    out[key] = out.get(key, 0) + 1
        return out


def measure(root: Path, config: dict, clients: list[int], rendered, label: str) -> list[Row]:
    server, base, config_file = start_server(root, config)
    endpoint = load_settings(config_file).endpoint
    pause_ms = endpoint.smart_pause_ms if endpoint.turn == "smart" else endpoint.endpoint_silence_ms
    rows = []
    try:
        url = base.replace("http", "ws") + "/v1/voice"
        asyncio.run(live_client(url, rendered[:1], 0))  # warm-up: the first decoders, the first reply
        for n in clients:
            time.sleep(6)  # the admission window turns over: the last level's load is gone
            before = metric_samples(httpx.get(base + "/metrics").text, "voicebot_input")
            main0, children0 = cpu_s(server.pid)
            t0 = time.monotonic()

            async def together():
                return await asyncio.gather(*(live_client(url, rendered[(TURNS * i) % len(rendered):][:TURNS],
                                                          i * CONNECT_SPREAD_S) for i in range(n)))

            runs = asyncio.run(together())
            elapsed = time.monotonic() - t0
            main1, children1 = cpu_s(server.pid)
            after = metric_samples(httpx.get(base + "/metrics").text, "voicebot_input")
            speakers = max(1, sum(r.admitted for r in runs))
            audio_s = sum(r.audio_s for r in runs)
            input_audio = total(after, "voicebot_input_audio_seconds_total") - total(before, "voicebot_input_audio_seconds_total")
            input_cpu = total(after, "voicebot_input_cpu_seconds_total") - total(before, "voicebot_input_cpu_seconds_total")
            rows.append(Row(
                n, runs, (main1 - main0) / elapsed / speakers, (children1 - children0) / elapsed / speakers,
                (histogram_quantile(before, after, "voicebot_input_lag_seconds", 0.5),
                 histogram_quantile(before, after, "voicebot_input_lag_seconds", 0.95)),
                input_cpu / input_audio * 1e6 if input_audio > 0 else None,
                (main1 - main0 + children1 - children0) / max(audio_s, 1e-9) * 1e6, pause_ms))
            print(f"  {label}: {n} clients done in {elapsed:.0f} s; admission's view: {capacity_view(base)}", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        os.unlink(config_file)
    return rows


def capacity_view(base: str) -> str:
    """Each pool's line as /readyz shows it (voicebot/serving/capacity.py): fixed + marginal per
    session, where learnt; a server without the line shows its own keys. Then the input lag p95
    learnt per number of sessions, at the busiest pool's load (its forecast's levels), where it has them."""
    readyz = httpx.get(base + "/readyz").json()
    pools = readyz.get("capacity", {})
    view = " ".join(f"{name} {p['fixed_load']:.3f}+{p['marginal_cost']:.3f}n" if p.get("marginal_cost") is not None
                    else f"{name} {json.dumps(p, separators=(',', ':'))}" for name, p in pools.items())
    levels = readyz.get("input_lag_forecast", {}).get("levels", {})
    return view + "".join(f"; lag p95 at {n} sessions {v['p95_s'] * 1000:.0f} ms at load {v['load']:.2f}" for n, v in levels.items())


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None or value != value else format(value * scale, spec)


def describe(row: Row) -> dict[str, str]:
    refused = [r.refusal for r in row.runs if not r.admitted]
    reasons: dict[str, int] = {}
    for e in refused:
        key = f"{e.get('code')}:{e.get('cause') or e.get('limit') or '-'}:{e.get('overloaded') or '-'}"
        key += f"@{e['retry_after_s']}s" if e.get("retry_after_s") is not None else " (no retry hint)"
        reasons[key] = reasons.get(key, 0) + 1
    latencies, lag = row.latencies(), row.client_lag()
    turns = sum(len(r.results) for r in row.admitted)
    return {
        "admitted": f"{len(row.admitted)}/{row.n}",
        "p50": fmt(pct(latencies, 50), ".0f"), "p95": fmt(pct(latencies, 95), ".0f"),
        "answered": f"{len(latencies)}/{turns}",
        "lag srv": f"{fmt(row.lag_server[0], '.0f', 1000)}/{fmt(row.lag_server[1], '.0f', 1000)}",
        "lag cli": f"{fmt(pct(lag, 50), '.0f')}/{fmt(pct(lag, 95), '.0f')}",
        "cpu main": fmt(row.cpu_main, ".3f"), "cpu kids": fmt(row.cpu_children, ".3f"),
        "input us": fmt(row.input_us, ".0f"), "whole us": fmt(row.whole_us, ".0f"),
        "refused": " ".join(f"{k}x{v}" for k, v in reasons.items()) or "-",
    }


def rendered_turns(voice: str, chunk_s: float) -> list[RenderedTurn]:
    """DISTINCT_TURNS complete English turns of the turn set in `voice`, shuffled the same way each
    run; the clients cycle over them, TURNS each."""
    t0 = time.monotonic()
    items = [item for item in turn_set(voice) if item.language == "en" and not item.paused]
    random.Random(7).shuffle(items)
    rendered = render_all(items[:DISTINCT_TURNS], voice=voice)
    print(f"{len(rendered)} complete English turns ({voice}) rendered in {time.monotonic() - t0:.0f} s; "
          f"{TURNS} per client, {chunk_s * 1000:.0f} ms chunks in real time", flush=True)
    return rendered


def bench_config(path: Path, sessions: int, lm: bool, rendered: list[RenderedTurn]) -> dict:
    """The config at `path`, room for `sessions`, and pocketsphinx (unless `lm`: its general English
    model) on a grammar of the turns' words."""
    config = yaml.safe_load(path.read_text())
    config.setdefault("server", {})["max_sessions"] = max(sessions, config["server"].get("max_sessions", 20))
    if not lm and config.get("asr", {}).get("engine", "pocketsphinx") == "pocketsphinx":
        config.setdefault("asr", {}).setdefault("pocketsphinx", {})["phrases"] = grammar(rendered)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24])
    parser.add_argument("--voice", choices=("espeak", "piper"), default="espeak")
    parser.add_argument("--lm", action="store_true", help="pocketsphinx's general English model, not the set's grammar")
    parser.add_argument("--ref", type=Path, help="another checkout, run the same way after this one")
    args = parser.parse_args()

    rendered = rendered_turns(args.voice, CHUNK_S)
    config = bench_config(Path(args.config), max(args.clients), args.lm, rendered)

    runs = {"this": measure(ROOT, config, args.clients, rendered, "this")}
    if args.ref:
        runs["ref"] = measure(args.ref.resolve(), config, args.clients, rendered, "ref")

    print(f"\nconfig {args.config} ({'general LM' if args.lm else 'grammar of the set'}), {os.cpu_count()} CPUs; "
          f"end of speech -> first reply frame at the client (ms); input lag p50/p95 (ms: server histogram, "
          f"client-side asked-pause); CPU cores per admitted speaker; input cost µs per session per s of audio")
    columns = ["admitted", "p50", "p95", "answered", "lag srv", "lag cli", "cpu main", "cpu kids", "input us", "whole us", "refused"]
    print(f"{'code':>5} {'N':>3} " + " ".join(f"{c:>9}" for c in columns[:-1]) + "  refused (code:cause:pool@retry x count)")
    for label, rows in runs.items():
        for row in rows:
            cells = describe(row)
            print(f"{label:>5} {row.n:>3} " + " ".join(f"{cells[c]:>9}" for c in columns[:-1]) + f"  {cells['refused']}")
    print("\nturns with no reply within 6 s of their end, by what happened (bench/latency.py's what_happened)")
    for label, rows in runs.items():
        for row in rows:
            print(f"{label:>5} {row.n:>3}  {row.fates() or '-'}")
    if "ref" in runs:
        print("\nratios this / ref (p50, p95 of end -> first frame; client-side lag p50; whole-server µs per s of audio)")
        for this, ref in zip(runs["this"], runs["ref"]):
            def ratio(a: float, b: float) -> str:
                return f"{a / b:.2f}x" if a == a and b == b and b > 0 else "-"
            print(f"{this.n:>3} clients: p50 {ratio(pct(this.latencies(), 50), pct(ref.latencies(), 50))}, "
                  f"p95 {ratio(pct(this.latencies(), 95), pct(ref.latencies(), 95))}, "
                  f"lag p50 {ratio(pct(this.client_lag(), 50), pct(ref.client_lag(), 50))}, "
                  f"cpu {ratio(this.whole_us, ref.whole_us)}")
    single = [row for row in runs["this"] if row.n == 1]
    for row in runs["this"]:
        if row.n in (8, 16):
            lat = row.latencies()
            base = pct(single[0].latencies(), 50) if single else float("nan")
            print(f"targets at {row.n}: admitted {len(row.admitted)}/{row.n}, p95 {fmt(pct(lat, 95), '.0f')} ms, "
                  f"p50 {fmt(pct(lat, 50), '.0f')} ms = {fmt(pct(lat, 50) / base, '.2f')}x the single speaker's")


if __name__ == "__main__":
    main()
