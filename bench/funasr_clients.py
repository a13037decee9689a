"""Live FunASR runtime clients at once on /funasr: how soon each sees its words, how far behind its input runs.

    python bench/funasr_clients.py [--config configs/default.yaml] [--clients 1 2 4 6 8]
                                   [--beside K] [--voice espeak|piper] [--lm] [--ref DIR]

N clients connect to one server (a subprocess on 127.0.0.1, the given config) over real WebSockets,
a few ms apart, and each speaks as FunASR's runtime Python client (runtime/python/websocket/
funasr_wss_client.py) does in its default 2pass mode from a microphone: the first message
{mode: 2pass, chunk_size: [5, 10, 5], chunk_interval: 10, wav_format: pcm, audio_fs: 16000, ...},
then 60 ms PCM chunks on the wall clock, then {is_speaking: false, is_end: true}. What it says:
0.4 s of silence, 2 complete English turns of tests/turn_set.py (espeak by default; `--voice piper`,
the Piper voice) with GAP_S of silence after each. Printed per N:
- admitted / refused (a refusal is FunASR's error result: its `code` and `retry_after_s`);
- first partial: the first non-empty `2pass-online` after the client's first chunk, p50 / p95 over
  the admitted clients (what issue 23 measured: 0.9 s alone, 6.1-7.5 s at 6 clients, on 77c2663);
- final after speech end: each `2pass-offline` with text, from the moment its turn's last sample
  was sent, p50 / p95 (it includes the endpointer's silence, endpoint.endpoint_silence_ms);
- final after is_end: the client's end message to the `is_final` result, p50 / p95;
- input lag p50 / p95: how far behind the wall clock the server processed the input, from its
  voicebot_input_lag_seconds histogram between two scrapes (`-` where the server does not count
  /funasr's input there);
- server CPU per admitted client (of both routes, with --beside), in cores (main process and its
  decoding children apart).

`--beside K`: K /v1/voice live speakers (bench/live_speakers.py's clients: 20 ms chunks, 2 turns,
each reply cut at its first frame) speak at the same time, loading the pools the /funasr streams
share; their end of speech to first reply frame p50 / p95 is printed too. The server's lag figures
then mix both routes (they are per decoding pool, not per route).

`--ref DIR` runs the same on another checkout right after, and prints both. pocketsphinx decodes
with a grammar of the set's phrases, as bench/live_speakers.py does; `--lm` keeps the config's own
model. Every figure is measured on whatever else the machine is doing: on a shared box, an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from bench.latency import pct  # noqa: E402
from bench.live_speakers import ClientRun as VoiceRun  # noqa: E402
from bench.live_speakers import (  # noqa: E402
    TURNS, bench_config, capacity_view, cpu_s, histogram_quantile, live_client, metric_samples, rendered_turns, start_server)
from tests.audio import to_pcm16  # noqa: E402
from tests.turn_set import RenderedTurn  # noqa: E402

RATE = 16000
# funasr_wss_client.py: a chunk of 60 * chunk_size[1] / chunk_interval ms, sent every as many ms.
CHUNK_SIZE, CHUNK_INTERVAL = [5, 10, 5], 10
CHUNK_S = 60 * CHUNK_SIZE[1] / CHUNK_INTERVAL / 1000
LEAD_S = 0.4  # silence before the first turn
GAP_S = 1.5  # silence after each turn: the endpointer's 0.5 s and the final's way back
CONNECT_SPREAD_S = 0.05
END_WAIT_S = 30.0  # after is_end, at most this long for the final result


@dataclass
class ClientRun:
    admitted: bool
    refusal: dict | None = None
    first_partial_s: float | None = None  # after the first chunk
    finals_after_speech_s: list[float] = field(default_factory=list)
    final_after_end_s: float | None = None


async def funasr_client(url: str, turns: list[RenderedTurn], delay_s: float, name: str) -> ClientRun:
    import websockets

    await asyncio.sleep(delay_s)
    async with websockets.connect(url, max_size=None, ping_interval=None) as ws:
        with contextlib.suppress(websockets.ConnectionClosed):  # refused: the error result came first, then the close
            await ws.send(json.dumps({"mode": "2pass", "chunk_size": CHUNK_SIZE, "chunk_interval": CHUNK_INTERVAL,
                                      "encoder_chunk_look_back": 4, "decoder_chunk_look_back": 0, "wav_name": name,
                                      "wav_format": "pcm", "audio_fs": RATE, "is_speaking": True, "hotwords": "", "itn": True}))
        received: list[tuple[float, dict]] = []
        refused = asyncio.get_running_loop().create_future()

        async def read() -> None:
            with contextlib.suppress(websockets.ConnectionClosed):
                async for message in ws:
                    result = json.loads(message)
                    received.append((time.monotonic(), result))
                    if "code" in result and result.get("is_final") and not refused.done():
                        refused.set_result(result)  # refused at admission: the error result, then the close

        reader = asyncio.create_task(read())
        speech_ends: list[float] = []  # wall time each turn's last sample was sent
        pcm = [to_pcm16(np.zeros(int(RATE * LEAD_S), np.float32))]
        position = int(RATE * LEAD_S)
        turn_end_samples = []  # where each turn's speech ends in the stream
        for turn in turns:
            pcm.append(to_pcm16(turn.audio))
            turn_end_samples.append(position + int(turn.end_s * RATE))
            position += len(turn.audio)
            pcm.append(to_pcm16(np.zeros(int(RATE * GAP_S), np.float32)))
            position += int(RATE * GAP_S)
        audio = b"".join(pcm)
        step = int(RATE * CHUNK_S) * 2
        first_sent = clock = time.monotonic()
        end_sent = None
        with contextlib.suppress(websockets.ConnectionClosed):
            for i in range(0, len(audio), step):
                if refused.done():
                    break
                clock += CHUNK_S
                await asyncio.sleep(max(0.0, clock - time.monotonic()))
                await ws.send(audio[i : i + step])
                sent_samples = (i + step) // 2
                while len(speech_ends) < len(turn_end_samples) and sent_samples >= turn_end_samples[len(speech_ends)]:
                    speech_ends.append(time.monotonic())
            if not refused.done():
                end_sent = time.monotonic()
                await ws.send(json.dumps({"is_speaking": False, "is_end": True}))
        deadline = time.monotonic() + END_WAIT_S  # for the final result, or the close
        while time.monotonic() < deadline and not reader.done() and not any(r.get("is_final") for _, r in received):
            await asyncio.sleep(0.05)
        reader.cancel()
        if refused.done():
            return ClientRun(False, refused.result())
        run = ClientRun(True)
    partials = [at for at, r in received if r.get("mode") == "2pass-online" and r.get("text")]
    run.first_partial_s = partials[0] - first_sent if partials else None
    finals = [(at, r) for at, r in received if r.get("mode") == "2pass-offline" and r.get("text") and "error" not in r]
    run.finals_after_speech_s = [at - speech_end for (at, _), speech_end in zip(finals, speech_ends)]
    ends = [at for at, r in received if r.get("is_final")]
    run.final_after_end_s = ends[0] - end_sent if ends and end_sent is not None else None
    return run


@dataclass
class Row:
    n: int
    runs: list[ClientRun]
    cpu_main: float
    cpu_children: float
    lag: tuple[float | None, float | None]
    readyz_lag: dict
    beside: list[VoiceRun]  # the /v1/voice speakers alongside

    @property
    def admitted(self) -> list[ClientRun]:
        return [r for r in self.runs if r.admitted]


def measure(root: Path, config: dict, clients: list[int], beside: int, rendered: list[RenderedTurn], label: str) -> list[Row]:
    server, base, config_file = start_server(root, config)
    rows = []
    try:
        url = base.replace("http", "ws") + "/funasr"
        voice_url = base.replace("http", "ws") + "/v1/voice"
        asyncio.run(funasr_client(url, rendered[:1], 0, "warm-up"))  # the first decoders, the first results
        for n in clients:
            time.sleep(6)  # the admission window turns over: the last level's load is gone
            before = metric_samples(httpx.get(base + "/metrics").text, "voicebot_input_lag")
            main0, children0 = cpu_s(server.pid)
            t0 = time.monotonic()

            def turns(i: int) -> list[RenderedTurn]:
                return rendered[(TURNS * i) % len(rendered):][:TURNS]

            async def together():
                voices = [live_client(voice_url, turns(n + i), (n + i) * CONNECT_SPREAD_S) for i in range(beside)]
                return await asyncio.gather(*(funasr_client(url, turns(i), i * CONNECT_SPREAD_S, f"client-{i}") for i in range(n)),
                                            *voices)

            results = asyncio.run(together())
            runs, voice_runs = list(results[:n]), list(results[n:])
            elapsed = time.monotonic() - t0
            main1, children1 = cpu_s(server.pid)
            readyz = httpx.get(base + "/readyz").json()
            after = metric_samples(httpx.get(base + "/metrics").text, "voicebot_input_lag")
            speakers = max(1, sum(r.admitted for r in [*runs, *voice_runs]))
            rows.append(Row(n, runs, (main1 - main0) / elapsed / speakers, (children1 - children0) / elapsed / speakers,
                            (histogram_quantile(before, after, "voicebot_input_lag_seconds", 0.5),
                             histogram_quantile(before, after, "voicebot_input_lag_seconds", 0.95)),
                            readyz.get("input_lag", {}), voice_runs))
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


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None or value != value else format(value * scale, spec)


def pair(values: list[float]) -> str:
    return f"{fmt(pct(values, 50), '.0f', 1000)}/{fmt(pct(values, 95), '.0f', 1000)}"


def describe(row: Row) -> dict[str, str]:
    admitted = row.admitted
    refused = [r.refusal for r in row.runs if not r.admitted]
    reasons: dict[str, int] = {}
    for e in refused:
        key = f"{e.get('code')}:{e.get('cause') or e.get('refusal') or '-'}@{e.get('retry_after_s')}s"
        reasons[key] = reasons.get(key, 0) + 1
    firsts = [r.first_partial_s for r in admitted if r.first_partial_s is not None]
    finals = [s for r in admitted for s in r.finals_after_speech_s]
    ends = [r.final_after_end_s for r in admitted if r.final_after_end_s is not None]
    replies = [t.first_audio_ms for r in row.beside if r.admitted for t in r.results if t.first_audio_ms is not None]
    return {
        "admitted": f"{len(admitted)}/{row.n}",
        "1st part": pair(firsts) + f" ({len(firsts)})",
        "final-spk": pair(finals) + f" ({len(finals)}/{TURNS * len(admitted)})",
        "final-end": pair(ends),
        "lag srv": f"{fmt(row.lag[0], '.0f', 1000)}/{fmt(row.lag[1], '.0f', 1000)}",
        "cpu main": fmt(row.cpu_main, ".3f"), "cpu kids": fmt(row.cpu_children, ".3f"),
        "voice": (f"{sum(r.admitted for r in row.beside)}/{len(row.beside)} {fmt(pct(replies, 50), '.0f')}/"
                  f"{fmt(pct(replies, 95), '.0f')}") if row.beside else "-",
        "refused": " ".join(f"{k}x{v}" for k, v in reasons.items()) or "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    parser.add_argument("--beside", type=int, default=0, help="/v1/voice live speakers at the same time")
    parser.add_argument("--voice", choices=("espeak", "piper"), default="espeak")
    parser.add_argument("--lm", action="store_true", help="pocketsphinx's general English model, not the set's grammar")
    parser.add_argument("--ref", type=Path, help="another checkout, run the same way after this one")
    args = parser.parse_args()

    rendered = rendered_turns(args.voice, CHUNK_S)
    config = bench_config(Path(args.config), max(args.clients) + args.beside, args.lm, rendered)

    runs = {"this": measure(ROOT, config, args.clients, args.beside, rendered, "this")}
    if args.ref:
        runs["ref"] = measure(args.ref.resolve(), config, args.clients, args.beside, rendered, "ref")

    print(f"\nconfig {args.config} ({'general LM' if args.lm else 'grammar of the set'}), {os.cpu_count()} CPUs; "
          f"p50/p95 in ms: first partial after the first chunk, final after its turn's speech end, final after "
          f"is_end; server input lag (voicebot_input_lag_seconds); CPU cores per admitted client; /v1/voice "
          f"speakers beside: admitted, end of speech -> first reply frame")
    columns = ["admitted", "1st part", "final-spk", "final-end", "lag srv", "cpu main", "cpu kids", "voice"]
    widths = [9, 15, 17, 11, 9, 9, 9, 15]
    print(f"{'code':>5} {'N':>3} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths)) + "  refused (code:cause@retry x count)")
    for label, rows in runs.items():
        for row in rows:
            cells = describe(row)
            print(f"{label:>5} {row.n:>3} " + " ".join(f"{cells[c]:>{w}}" for c, w in zip(columns, widths)) + f"  {cells['refused']}")
    print("\n/readyz input_lag after each N (per pool: chunks in the last 5 s, p50/p95 s, deadline misses since start)")
    for label, rows in runs.items():
        for row in rows:
            print(f"{label:>5} {row.n:>3}  " + (" ".join(f"{pool} {p['chunks']}ch {p['p50_s']}/{p['p95_s']} miss {p['deadline_misses']}"
                                                      for pool, p in row.readyz_lag.items()) or "-"))


if __name__ == "__main__":
    main()
