"""A /funasr stream's input keeps to the wall clock while other sessions load the pools, and its lag
is the server's to see: the real server on 127.0.0.1 (default config), real WebSockets, a probe that
speaks the FunASR runtime client's wire (funasr_wss_client.py's 2pass first message, 60 ms PCM
chunks in real time, {is_speaking: false, is_end: true}). What is checked is the scheduling and the
accounting, not this machine's speed: every chunk's lag is counted once, by the server's own
InputLag (voicebot/serving/lateness.py: what /readyz and admission read), under a generous bound;
messages that waited behind a stalled VAD are counted from their arrival, and go through in one trip."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time

import numpy as np
import pytest
import websockets

from tests.conftest import TEST_PHRASES, VoiceClient, make_settings, running_server, speech_pcm
from voicebot.frontends.funasr_protocol import FunasrSession
from voicebot.serving.lateness import InputLag

RATE = 16000
CHUNK_S = 0.06  # funasr_wss_client.py: 60 * chunk_size[1] / chunk_interval ms, chunk_size [5, 10, 5], interval 10
CHUNK_BYTES = int(RATE * CHUNK_S) * 2
# A lag the slowest sane machine stays under (a chunk's trip takes milliseconds).
BOUND_S = 1.0
STALL_S = 1.0


async def runtime_client(url: str, pcm: bytes, on_chunk=None) -> tuple[int, list[dict]]:
    """funasr_wss_client.py's 2pass stream from a microphone: how many audio messages it sent, and
    every result up to the one echoing is_end."""
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"mode": "2pass", "chunk_size": [5, 10, 5], "chunk_interval": 10, "wav_name": "probe",
                                  "wav_format": "pcm", "audio_fs": RATE, "is_speaking": True, "hotwords": "", "itn": True}))
        start, sent = time.monotonic(), 0
        for k, i in enumerate(range(0, len(pcm), CHUNK_BYTES)):
            if on_chunk is not None:
                on_chunk(k)
            await asyncio.sleep(max(0.0, start + k * CHUNK_S - time.monotonic()))
            await ws.send(pcm[i : i + CHUNK_BYTES])
            sent += 1
        await ws.send(json.dumps({"is_speaking": False, "is_end": True}))
        results = []
        while not (results and results[-1].get("is_end")):
            results.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
        return sent, results


def funasr_lags(monkeypatch) -> list[tuple[str, float]]:
    """(pool, lag) of every /funasr chunk the server's InputLag observes."""
    seen: list[tuple[str, float]] = []
    observe = InputLag.observe

    def recorded(self, pool, session, lags):
        lags = list(lags)
        if session.startswith("funasr-"):
            seen.extend((pool, lag) for lag in lags)
        return observe(self, pool, session, lags)

    monkeypatch.setattr(InputLag, "observe", recorded)
    return seen


def test_a_funasr_stream_keeps_to_the_wall_clock_while_six_sessions_load_the_pools(monkeypatch):
    """Six /v1/voice sessions stream speech at twice real time (the decoding children, the input
    clock, Smart Turn, espeak's replies all busy) while the probe speaks live on /funasr."""
    lags = funasr_lags(monkeypatch)
    with running_server(make_settings()) as server:
        speech = speech_pcm(TEST_PHRASES[0])
        probe = speech_pcm(TEST_PHRASES[1], lead_s=0.5, tail_s=1.5) * 2  # two utterances, live

        async def other(client: VoiceClient) -> None:
            for _ in range(3):
                await client.stream(speech, chunk_ms=20, speed=2)

        async def run() -> tuple[int, list[dict]]:
            async with contextlib.AsyncExitStack() as stack:
                others = [await stack.enter_async_context(VoiceClient.connect(server.ws_url)) for _ in range(6)]
                loads = [asyncio.create_task(other(c)) for c in others]
                answer = await runtime_client(server.ws_url.replace("/v1/voice", "/funasr"), probe)
                await asyncio.gather(*loads)
            return answer

        sent, results = asyncio.run(run())
        pools = server.get("/readyz").json()["input_lag"]
    assert len(lags) == sent  # every chunk through, counted once
    values = [lag for _, lag in lags]
    assert np.percentile(values, 95) < BOUND_S and max(values) < 2 * BOUND_S
    assert {pool for pool, _ in lags} <= set(pools) and all(pool.startswith("pocketsphinx-") for pool, _ in lags)
    assert [r for r in results if r["mode"] == "2pass-offline" and r["text"]]  # the probe's speech recognised
    assert results[-1]["is_final"] and "error" not in results[-1]


def held_vad(server) -> tuple[threading.Event, threading.Event]:
    """(stall, release): once `stall` is set, the server's VAD batcher waits in its next step until
    `release` is."""
    stall, release = threading.Event(), threading.Event()
    batcher = server.runtime.vad
    call = batcher._call

    def held(requests):
        if stall.is_set() and not release.is_set():
            release.wait()
        return call(requests)

    batcher._call = held  # an instance attribute: what the batcher's thread calls for each step
    return stall, release


def test_a_funasr_stream_behind_a_stalled_vad_is_counted_late_and_catches_up_in_one_trip(monkeypatch):
    """The VAD batcher (the /funasr segmenter's Silero) held for STALL_S while the probe speaks:
    the messages that arrived meanwhile are counted late from their arrival (admission sees it),
    then go through the segmenter and the recognizer in one trip, and the stream is back on time."""
    lags = funasr_lags(monkeypatch)
    trips: list[tuple[int, float]] = []  # (messages, when) of each of the probe's audio trips
    on_audio = FunasrSession.on_audio

    async def recorded(self, data, arrived=()):
        out = await on_audio(self, data, arrived)
        trips.append((len(arrived), time.monotonic()))
        return out

    monkeypatch.setattr(FunasrSession, "on_audio", recorded)
    with running_server(make_settings()) as server:
        stall, release = held_vad(server)
        probe = bytes(int(RATE * 1.0) * 2) + speech_pcm(TEST_PHRASES[2], lead_s=0.2, tail_s=1.5)

        def at_chunk(k: int) -> None:
            if k == int(0.5 / CHUNK_S):  # half a second in
                stall.set()
                threading.Timer(STALL_S, release.set).start()

        sent, results = asyncio.run(runtime_client(server.ws_url.replace("/v1/voice", "/funasr"), probe, at_chunk))
        misses = server.get("/readyz").json()["input_lag"]
    assert len(lags) == sent and sum(n for n, _ in trips) == sent  # every chunk through, counted once
    stalled = STALL_S / CHUNK_S  # messages that arrived during the stall
    biggest = max(n for n, _ in trips)
    assert biggest >= 0.6 * stalled and len(trips) <= sent - biggest + 3  # one trip for them, not one each
    values = np.array([lag for _, lag in lags])
    assert (values > 0.5 * STALL_S).sum() >= 0.4 * stalled  # their wait is counted
    assert sum(p["deadline_misses"] for p in misses.values()) >= 0.4 * stalled
    released = trips[[n for n, _ in trips].index(biggest)][1]
    ends = np.cumsum([n for n, _ in trips])  # each trip's lags end there in the observed order
    after = [values[end - n : end] for (n, at), end in zip(trips, ends) if at > released + 1.0]
    assert after, "the probe spoke for more than 1 s after the stall"
    assert np.concatenate(after).max() < BOUND_S  # and after it, back on the wall clock
    assert results[-1]["is_final"] and [r for r in results if r["mode"] == "2pass-offline" and r["text"]]


def test_what_a_client_sent_before_going_away_is_heard_or_counted_as_dropped(monkeypatch):
    """The VAD held on a client's first message while it sends the rest of 1.2 s of audio and goes
    away: the message in its trip is heard, every one waiting behind it is counted as dropped
    (client_gone), none twice."""
    with running_server(make_settings()) as server:
        stall, release = held_vad(server)
        url = server.ws_url.replace("/v1/voice", "/funasr")
        pcm = speech_pcm(TEST_PHRASES[0], lead_s=0.2, tail_s=0.5)[: 20 * CHUNK_BYTES]

        def counts() -> tuple[float, float]:
            return (server.metric("voicebot_input_audio_seconds_total"),
                    server.metric("voicebot_input_dropped_seconds_total", 'reason="client_gone"'))

        async def send_and_go() -> None:
            async with websockets.connect(url) as ws:
                await ws.send(json.dumps({"mode": "2pass", "wav_name": "gone", "wav_format": "pcm", "audio_fs": RATE,
                                          "is_speaking": True}))
                stall.set()
                threading.Timer(STALL_S, release.set).start()
                await ws.send(pcm[:CHUNK_BYTES])  # its trip is held in the VAD
                await asyncio.sleep(0.3)
                for i in range(CHUNK_BYTES, len(pcm), CHUNK_BYTES):
                    await ws.send(pcm[i : i + CHUNK_BYTES])

        heard0, dropped0 = counts()
        asyncio.run(send_and_go())
        deadline = time.monotonic() + 10
        while counts()[1] == dropped0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        heard1, dropped1 = counts()
    sent_s = len(pcm) / (2 * RATE)
    assert heard1 - heard0 == pytest.approx(CHUNK_S, abs=1e-6)  # the held trip's message, heard once released
    assert dropped1 - dropped0 == pytest.approx(sent_s - CHUNK_S, abs=1e-6)  # everything that waited behind it


def test_obs_audio_and_realtime_sessions_go_through_the_input_clock_and_are_counted(monkeypatch):
    """The routes that share the pools besides /funasr: /obs/audio and /v1/realtime sessions are
    /v1/voice Sessions (voicebot/frontends/run.py). Their chunks go through the input clock's
    thread (FrontEnd.prepare there), each chunk's lag is counted by InputLag, and they count in
    the number of sessions admission reads, as a /funasr connection does."""
    from tests.browser.support import obs_audio_message
    from voicebot.session.listening import FrontEnd

    lags: dict[str, int] = {}
    observe = InputLag.observe

    def observed(self, pool, session, chunk_lags):
        chunk_lags = list(chunk_lags)
        lags[session] = lags.get(session, 0) + len(chunk_lags)
        return observe(self, pool, session, chunk_lags)

    threads: set[str] = set()
    prepare = FrontEnd.prepare

    def prepared(self, *chunks):
        threads.add(threading.current_thread().name)
        return prepare(self, *chunks)

    monkeypatch.setattr(InputLag, "observe", observed)
    monkeypatch.setattr(FrontEnd, "prepare", prepared)
    with running_server(make_settings()) as server:
        base = server.ws_url.removesuffix("/v1/voice")

        async def run() -> tuple[int, str]:
            lags.clear()  # running_server's own warm-up session's are not these
            threads.clear()
            async with (websockets.connect(f"{base}/obs/audio?channel=obs-test") as obs,
                        websockets.connect(f"{base}/v1/realtime?model=voicebot") as realtime,
                        websockets.connect(f"{base}/funasr") as funasr):
                created = json.loads(await asyncio.wait_for(realtime.recv(), 10))
                assert created["type"] == "session.created"
                await funasr.send(json.dumps({"mode": "2pass", "wav_format": "pcm", "audio_fs": RATE, "is_speaking": True}))
                for _ in range(20):  # 1 s of each, live
                    await obs.send(obs_audio_message(np.zeros((2400, 2), np.float32), rate=48000))
                    await realtime.send(json.dumps({"type": "input_audio_buffer.append",
                                                    "audio": base64.b64encode(bytes(2 * 1200)).decode()}))
                    await funasr.send(bytes(CHUNK_BYTES))
                    await asyncio.sleep(0.05)
                occupied = server.on_loop(server.app.state.occupied)
            return occupied, created["session"]["id"].removeprefix("sess_")

        occupied, realtime_id = asyncio.run(run())
    assert occupied == 3  # the three connections, as admission counts them
    assert threads == {"input-clock"}  # the sessions' front ends ran there only
    sessions = {s for s, n in lags.items() if n and not s.startswith("funasr-")}
    assert len(sessions) == 2 and realtime_id in sessions  # /obs/audio's and /v1/realtime's chunks counted
    assert any(s.startswith("funasr-") and n for s, n in lags.items())
