"""A session's input keeps to the wall clock while other sessions load the pools: the real server on
127.0.0.1, real WebSockets and speech. What is checked is the scheduling, not this machine's speed:
chunks that waited go through the input path in one trip, so a session that fell behind is back
within a generous bound; the lag is reported per pool in /readyz and voicebot_input_lag_seconds."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np

from tests.conftest import TEST_PHRASES, VoiceClient, make_settings, running_server, speech_pcm
from voicebot.session.listening import FrontEnd, Listening

CHUNK_MS = 20
STALL_S = 1.0  # the input clock held this long
# A lag the slowest sane machine stays under once the stall is over (a chunk's trip takes milliseconds).
CAUGHT_UP_LAG_S = 1.0


def test_a_session_behind_a_stalled_pool_catches_up_in_one_trip_while_others_load_it(monkeypatch):
    trips: list[tuple[int, float]] = []  # (chunks, when) of each front-end call of the probe session
    prepare = FrontEnd.prepare
    probe_rate = 8000  # the probe's own sample rate tells its calls from the others'
    stall, release = threading.Event(), threading.Event()

    def recorded(self, *chunks):
        if stall.is_set() and not release.is_set():
            release.wait()  # the input clock's thread held: every session's input waits
        if self.input_rate == probe_rate:
            trips.append((len(chunks), time.monotonic()))
        return prepare(self, *chunks)

    monkeypatch.setattr(FrontEnd, "prepare", recorded)
    with running_server(make_settings()) as server:
        speech = speech_pcm(TEST_PHRASES[0])
        probe_audio = bytes(2 * probe_rate * 4)  # 4 s of silence at 8 kHz: 200 chunks of 20 ms

        async def other(client: VoiceClient) -> None:
            for _ in range(3):
                await client.stream(speech, chunk_ms=CHUNK_MS, speed=2)

        async def probe() -> list[float]:
            async with VoiceClient.connect(server.ws_url, sample_rate=probe_rate) as client:
                sent_at = []
                step = 2 * probe_rate * CHUNK_MS // 1000
                start = time.monotonic()
                for k, i in enumerate(range(0, len(probe_audio), step)):
                    if k == 50:  # 1 s in: the input clock held for STALL_S
                        stall.set()
                        threading.Timer(STALL_S, release.set).start()
                    await asyncio.sleep(max(0.0, start + k * CHUNK_MS / 1000 - time.monotonic()))
                    await client.ws.send(probe_audio[i : i + step])
                    sent_at.append(time.monotonic())
                await asyncio.sleep(0.5)
                return sent_at

        async def run():
            async with contextlib.AsyncExitStack() as stack:
                others = [await stack.enter_async_context(VoiceClient.connect(server.ws_url)) for _ in range(3)]
                loads = [asyncio.create_task(other(c)) for c in others]
                sent_at = await probe()
                await asyncio.gather(*loads)
            return sent_at

        sent_at = asyncio.run(run())
        readyz = server.get("/readyz").json()
        metrics = server.get("/metrics").text

    chunks = len(sent_at)
    assert sum(n for n, _ in trips) == chunks  # every chunk heard, once
    # The ~50 chunks sent during the stall went through in one trip (give or take the one in
    # flight when it began): not 50 trips, each waiting for the last.
    biggest = max(n for n, _ in trips)
    assert biggest >= 0.6 * STALL_S * 1000 / CHUNK_MS
    assert len(trips) <= chunks - biggest + 3
    # And after it the session kept to the wall clock: its last second's chunks were each through
    # the front end within a generous bound of being sent.
    released = trips[[n for n, _ in trips].index(biggest)][1]
    late = [at for n, at in trips if at > released + 1.0]
    assert late, "the probe sent for 2 s after the stall"
    per_chunk = np.cumsum([n for n, _ in trips])
    for (n, at), heard in zip(trips, per_chunk):
        if at > released + 1.0:
            assert at - sent_at[heard - 1] < CAUGHT_UP_LAG_S
    pools = readyz["input_lag"]
    assert pools and all(p["chunks"] > 0 and p["p95_s"] is not None for p in pools.values())
    assert sum(p["deadline_misses"] for p in pools.values()) >= 0.6 * STALL_S * 1000 / CHUNK_MS  # the stall's, counted
    assert 'voicebot_input_lag_seconds_bucket{le="0.1",pool="pocketsphinx-' in metrics
    assert set(readyz["input_lag_forecast"]) == {"levels", "measured_sessions", "next_session"}  # what admission goes by


def test_a_burst_of_connects_before_any_cost_is_known_is_let_in_as_configured_and_told_why_not(monkeypatch):
    with running_server(make_settings(limits={"cold_start_sessions": 1})) as server:
        admission = server.runtime.admission

        def nothing_learnt() -> None:
            """As at start-up (running_server's own first session taught the pools), and nothing
            learnt from here on: the loads stay as measured."""
            for pool in admission.pools:
                pool.levels.clear()
                pool.cost_bound = None
                monkeypatch.setattr(pool, "sample", lambda sessions, pool=pool: pool.load())

        async def run():
            server.on_loop(nothing_learnt)
            async with VoiceClient.connect(server.ws_url):  # one in: the most per 5 s until a cost is known
                readyz = server.get("/readyz")
                async with VoiceClient.connect(server.ws_url, send_start=False) as refused:
                    busy = await refused.wait_for("error")
                return readyz, busy

        readyz, busy = asyncio.run(run())
        assert readyz.status_code == 503 and readyz.json()["full"]
        assert busy["code"] == "busy" and busy["cause"] == "cold_start" and busy["retry_after_s"] > 0 and busy["overloaded"]
        assert server.metric("voicebot_sessions_refused_total", 'reason="cold_start"') == 1


def test_a_session_s_input_keeps_to_the_wall_clock_while_six_others_load_the_pools(monkeypatch):
    """No stall: six sessions stream speech at twice real time (the recognizer's children, Smart Turn,
    espeak's replies and the input clock all busy) while a probe streams 4 s of silence in live 20 ms
    chunks. Each of its chunks is counted once by the server's own accounting (Listening._heard:
    arrival to the end of its trip), and they stay within a generous bound of real time."""
    probe_rate = 8000
    lags: list[float] = []
    heard = Listening._heard

    def recorded(self, chunks):
        if self.front_end.input_rate == probe_rate:
            now = time.monotonic()
            lags.extend(now - c.arrived for c in chunks)
        return heard(self, chunks)

    monkeypatch.setattr(Listening, "_heard", recorded)
    # Seven sessions, a decoder each: one beyond the pool is refused while others speak (`decoders`).
    with running_server(make_settings(asr={"pocketsphinx": {"phrases": TEST_PHRASES, "decoders": 8}})) as server:
        speech = speech_pcm(TEST_PHRASES[0])
        probe_audio = bytes(2 * probe_rate * 4)

        async def other(client: VoiceClient) -> None:
            for _ in range(3):
                await client.stream(speech, chunk_ms=CHUNK_MS, speed=2)

        async def probe() -> int:
            async with VoiceClient.connect(server.ws_url, sample_rate=probe_rate) as client:
                step = 2 * probe_rate * CHUNK_MS // 1000
                start, sent = time.monotonic(), 0
                for k, i in enumerate(range(0, len(probe_audio), step)):
                    await asyncio.sleep(max(0.0, start + k * CHUNK_MS / 1000 - time.monotonic()))
                    await client.ws.send(probe_audio[i : i + step])
                    sent += 1
                await asyncio.sleep(0.5)
                return sent

        async def run() -> int:
            async with contextlib.AsyncExitStack() as stack:
                others = [await stack.enter_async_context(VoiceClient.connect(server.ws_url)) for _ in range(6)]
                loads = [asyncio.create_task(other(c)) for c in others]
                sent = await probe()
                await asyncio.gather(*loads)
            return sent

        sent = asyncio.run(run())
    assert len(lags) == sent  # every chunk through, once
    assert np.percentile(lags, 95) < CAUGHT_UP_LAG_S and max(lags) < 2 * CAUGHT_UP_LAG_S
