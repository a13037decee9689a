"""pocketsphinx's decoding processes (voicebot/asr/pocketsphinx_process.py): streams bound to a
child for their life, a child that dies or hangs replaced and its streams told, no child left after close."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import pytest

from tests.audio import espeak_speech
from tests.conftest import TEST_PHRASES, VoiceClient, make_settings, running_server, speech_pcm
from voicebot.asr import pocketsphinx_process
from voicebot.asr.pocketsphinx import FULL_RETRY_AFTER_S, PocketsphinxRecognizer
from voicebot.asr.pocketsphinx_process import (ANSWER_FLOOR_S, ANSWER_S_PER_AUDIO_S, MAX_BATCH_BYTES, MAX_FEED_BYTES,
                                               DecoderProcess, DecoderProcessLost)
from voicebot.config.engines import PocketsphinxConfig


def utterance(phrase: str) -> np.ndarray:
    return np.concatenate([np.zeros(4800, np.float32), espeak_speech(phrase), np.zeros(8000, np.float32)])


async def transcribe(stream, audio: np.ndarray) -> str:
    for i in range(0, len(audio), 640):
        await stream.accept(audio[i : i + 640])
    return (await stream.finish()).text


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie its new parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(gone(pid) for pid in pids)


@pytest.fixture
def recognizer():
    engine = PocketsphinxRecognizer(PocketsphinxConfig(phrases=TEST_PHRASES, decoders=2, processes=2))
    engine.load()
    pids = [process.pid for process in engine.processes]
    yield engine
    engine.close()
    assert all(gone(pid) for pid in pids + [process.pid for process in engine.processes if process.pid])


def test_streams_are_spread_over_the_processes_and_share_the_cepstral_mean(recognizer):
    audio = utterance(TEST_PHRASES[0])

    async def scenario() -> tuple[list[str], list[str]]:
        streams = [recognizer.open() for _ in range(4)]
        assert [s.process.name for s in streams] == ["pocketsphinx-0", "pocketsphinx-1"] * 2
        texts = await asyncio.gather(*(transcribe(s, audio) for s in streams))
        mean = recognizer.cepstral_mean
        # The next stream on either process starts from the server's last utterance's mean.
        later = [recognizer.open() for _ in range(2)]
        again = await asyncio.gather(*(transcribe(s, audio) for s in later))
        await asyncio.gather(*(s.close() for s in streams + later))
        assert mean and recognizer.cepstral_mean
        return texts, again

    texts, again = asyncio.run(scenario())
    assert texts == [TEST_PHRASES[0]] * 4 and again == [TEST_PHRASES[0]] * 2
    assert [p.streams for p in recognizer.processes] == [0, 0]
    assert all(p.busy_s > 0 for p in recognizer.processes)  # the children's CPU, for admission control


def test_a_killed_child_fails_its_streams_clearly_is_replaced_and_counted(recognizer):
    audio = utterance(TEST_PHRASES[1])
    victim = recognizer.processes[0]

    async def scenario() -> None:
        stream = recognizer.open()
        assert stream.process is victim
        await stream.accept(audio[:6400])
        old_pid = victim.pid
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(DecoderProcessLost, match="pocketsphinx-0's process died"):
            for i in range(6400, len(audio), 640):  # the next request finds it dead (or dies with it)
                await stream.accept(audio[i : i + 640])
        assert victim.lost == {"died": 1, "hung": 0} and victim.pid not in (None, old_pid) and gone(old_pid)
        assert recognizer.info().details["processes_lost"] == 1
        # Its later requests fail the same way until the session's reset binds it to a live child.
        with pytest.raises(DecoderProcessLost):
            await stream.finish()
        report = await stream.reset()
        assert report.generation == 1
        assert await transcribe(stream, audio) == TEST_PHRASES[1]
        # And a new stream on the new child.
        fresh = [recognizer.open() for _ in range(2)]
        assert victim in {s.process for s in fresh}
        assert await asyncio.gather(*(transcribe(s, audio) for s in fresh)) == [TEST_PHRASES[1]] * 2
        await asyncio.gather(*(s.close() for s in [stream, *fresh]))

    asyncio.run(scenario())


# A hung child is waited for this long past its request's deadline (which the tests shorten) at most.
HANG_SLACK_S = 30


def test_a_request_has_a_deadline_from_the_audio_it_decodes():
    process = DecoderProcess(0, [], False, keep=1)  # never spawned: the deadline is the server side's arithmetic
    chunk = bytes(2 * 640)  # 40 ms
    assert process.answer_deadline_s(("open", 7, None)) == ANSWER_FLOOR_S
    assert process.answer_deadline_s(("feed", 7, chunk)) == pytest.approx(ANSWER_FLOOR_S + 0.04 * ANSWER_S_PER_AUDIO_S)
    for _ in range(74):  # 3 s in all
        process.answer_deadline_s(("feed", 7, chunk))
    process.answer_deadline_s(("feed", 8, chunk))  # another stream's utterance is its own
    # The end of the utterance searches all of it again; the next request starts from nothing.
    assert process.answer_deadline_s(("finish", 7, None)) == pytest.approx(ANSWER_FLOOR_S + 3 * ANSWER_S_PER_AUDIO_S)
    assert process.answer_deadline_s(("close", 7, None)) == ANSWER_FLOOR_S
    assert process.answer_deadline_s(("renew", 8, None)) == pytest.approx(ANSWER_FLOOR_S + 0.04 * ANSWER_S_PER_AUDIO_S)


def test_a_long_feed_goes_to_the_child_in_pieces_of_at_most_a_second(recognizer, monkeypatch):
    audio = np.concatenate([utterance(TEST_PHRASES[0]), np.zeros(16000, np.float32)])
    assert len(audio) * 2 > 2 * MAX_FEED_BYTES  # three pieces, the last a short one
    process = recognizer.processes[0]
    sent: list[list[int]] = []  # per request to the child with feeds, its feeds' bytes
    round_trip = process._round_trip

    def recorded(request):
        feeds = [len(piece[2]) for piece in request[2] if piece[0] == "feed"] if request[0] == "batch" else []
        if feeds:  # (the stream's open goes in a batch too)
            sent.append(feeds)
        return round_trip(request)

    monkeypatch.setattr(process, "_round_trip", recorded)

    async def scenario() -> str:
        stream = recognizer.open()
        assert stream.process is process
        try:
            await stream.accept(audio)  # one call, as /v1/audio/transcriptions makes
            return (await stream.finish()).text
        finally:
            await stream.close()

    assert asyncio.run(scenario()) == TEST_PHRASES[0]
    pieces = [size for request in sent for size in request]
    assert sum(pieces) == len(audio) * 2 and max(pieces) == MAX_FEED_BYTES and len(pieces) == -(-len(audio) * 2 // MAX_FEED_BYTES)
    assert all(sum(request) <= MAX_BATCH_BYTES for request in sent) and len(sent) == 2  # two pieces, then the third


def test_a_hung_child_is_killed_its_streams_fail_clearly_and_it_is_replaced(recognizer, monkeypatch):
    monkeypatch.setattr(pocketsphinx_process, "ANSWER_FLOOR_S", 2.0)
    audio = utterance(TEST_PHRASES[1])
    victim, other = recognizer.processes

    async def scenario() -> None:
        stream, elsewhere, neighbour = (recognizer.open() for _ in range(3))
        assert (stream.process, elsewhere.process, neighbour.process) == (victim, other, victim)
        await stream.accept(audio[:6400])
        await neighbour.accept(audio[:6400])
        old_pid = victim.pid
        os.kill(old_pid, signal.SIGSTOP)
        try:
            with pytest.raises(DecoderProcessLost, match=r"pocketsphinx-0's process did not answer within 2 s \(hung\)"):
                await asyncio.wait_for(stream.accept(audio[6400:7040]), HANG_SLACK_S)
        finally:
            if not gone(old_pid):
                os.kill(old_pid, signal.SIGCONT)  # the test failed: the child must not stay stopped
        assert victim.lost == {"died": 0, "hung": 1} and wait_gone([old_pid]) and victim.pid not in (None, old_pid)
        assert recognizer.info().details["processes_lost"] == 1
        # The other stream on it lost its utterance too; the stream on the other child never knew.
        with pytest.raises(DecoderProcessLost, match="pocketsphinx-0's process was lost earlier"):
            await neighbour.finish()
        assert await transcribe(elsewhere, audio) == TEST_PHRASES[1]
        # Each goes on after its reset, on a live child.
        for lost in (stream, neighbour):
            await lost.reset()
            assert await transcribe(lost, audio) == TEST_PHRASES[1]
        await asyncio.gather(*(s.close() for s in (stream, elsewhere, neighbour)))

    asyncio.run(scenario())


def test_a_child_that_died_idle_is_replaced_before_the_next_stream(recognizer):
    victim = recognizer.processes[0]
    old_pid = victim.pid
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while victim._child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)

    async def scenario() -> str:
        stream = recognizer.open()
        assert stream.process is victim
        try:
            return await transcribe(stream, utterance(TEST_PHRASES[2]))
        finally:
            await stream.close()

    assert asyncio.run(scenario()) == TEST_PHRASES[2]
    assert victim.lost == {"died": 1, "hung": 0} and victim.pid != old_pid


def test_a_child_that_cannot_build_its_decoders_fails_the_start_up():
    engine = PocketsphinxRecognizer(PocketsphinxConfig(phrases=["zzqxv blorf"], processes=1))
    with pytest.raises(RuntimeError, match="pocketsphinx-0 could not build its decoders: ValueError"):
        engine.load()
    assert engine.processes[0].pid is None  # killed and reaped


def test_the_child_imports_nothing_of_the_server():
    code = ("import sys, voicebot.asr.pocketsphinx_process, pocketsphinx; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('voicebot', 'fastapi', 'pydantic', 'numpy', 'torch'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert set(loaded) == {"voicebot", "voicebot.asr", "voicebot.asr.pocketsphinx_decoders", "voicebot.asr.pocketsphinx_process",
                           "voicebot.memory", "voicebot.serving", "voicebot.serving.worker"}


def test_the_children_of_a_server_killed_outright_exit():
    """No orphan: a child reads the end of its pipe when the server's side closes, however it ends."""
    code = ("from voicebot.asr.pocketsphinx import PocketsphinxRecognizer; from voicebot.config.engines import PocketsphinxConfig; "
            "e = PocketsphinxRecognizer(PocketsphinxConfig(phrases=['hello there'], processes=2)); e.load(); "
            "print(*[p.pid for p in e.processes], flush=True); import time; time.sleep(60)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        children = [int(pid) for pid in server.stdout.readline().split()]
        assert len(children) == 2 and not any(gone(pid) for pid in children)
    finally:
        server.kill()
        server.wait()
    assert wait_gone(children)


def test_a_session_whose_child_is_killed_gets_an_error_and_goes_on():
    settings = make_settings(asr={"pocketsphinx": {"phrases": TEST_PHRASES, "processes": 1}})
    with running_server(settings) as server:
        process = server.runtime.recognizer.processes[0]

        async def scenario() -> None:
            async with VoiceClient.connect(server.ws_url) as client:
                speech = speech_pcm(TEST_PHRASES[3])
                await client.stream(speech[: len(speech) // 2], speed=4)
                await client.wait_for("speech.started")
                os.kill(process.pid, signal.SIGKILL)
                await client.stream(speech[len(speech) // 2 :], speed=4)
                error = await client.wait_for("error")
                assert error["code"] == "engine_error" and error["engine"] == "asr"
                assert "pocketsphinx-0's process died" in error["message"]
                # The same session's next utterance, on the new child.
                await client.stream(speech_pcm(TEST_PHRASES[3]), speed=4)
                final = await client.wait_for("asr.final")
                assert final["text"] == TEST_PHRASES[3]
            async with VoiceClient.connect(server.ws_url) as client:  # and the next session
                await client.stream(speech_pcm(TEST_PHRASES[0]), speed=4)
                assert (await client.wait_for("asr.final"))["text"] == TEST_PHRASES[0]

        asyncio.run(scenario())
        assert process.lost == {"died": 1, "hung": 0}
        assert server.metric("voicebot_decoder_processes_lost_total", 'cause="died",engine="pocketsphinx"') == 1
        assert 'voicebot_decoder_processes_lost_total{cause="hung",engine="pocketsphinx"} 0.0' in server.get("/metrics").text
        pid = process.pid
    assert gone(pid)


def test_a_session_whose_child_hangs_gets_an_error_and_goes_on(monkeypatch):
    monkeypatch.setattr(pocketsphinx_process, "ANSWER_FLOOR_S", 2.0)
    settings = make_settings(asr={"pocketsphinx": {"phrases": TEST_PHRASES, "processes": 1}})
    with running_server(settings) as server:
        process = server.runtime.recognizer.processes[0]
        assert 'voicebot_decoder_processes_lost_total{cause="hung",engine="pocketsphinx"} 0.0' in server.get("/metrics").text

        async def scenario() -> None:
            async with VoiceClient.connect(server.ws_url) as client:
                speech = speech_pcm(TEST_PHRASES[2])
                await client.stream(speech[: len(speech) // 2], speed=4)
                await client.wait_for("speech.started")
                stopped = process.pid
                os.kill(stopped, signal.SIGSTOP)
                try:
                    await client.stream(speech[len(speech) // 2 :], speed=4)
                    error = await client.wait_for("error", timeout=HANG_SLACK_S)
                finally:
                    if not gone(stopped):
                        os.kill(stopped, signal.SIGCONT)
                assert error["code"] == "engine_error" and error["engine"] == "asr"
                # 2 s and 4 s per s of the audio in its batch (chunks that waited go together)
                assert re.search(r"pocketsphinx-0's process did not answer within \d+ s \(hung\)", error["message"])
                await client.stream(speech_pcm(TEST_PHRASES[2]), speed=4)
                assert (await client.wait_for("asr.final"))["text"] == TEST_PHRASES[2]

        asyncio.run(scenario())
        assert process.lost == {"died": 0, "hung": 1}
        assert server.metric("voicebot_decoder_processes_lost_total", 'cause="hung",engine="pocketsphinx"') == 1
        assert server.get("/readyz").json()["engines"][0]["details"]["processes_lost"] == 1


def test_feeds_queued_while_a_batch_is_in_flight_go_to_the_child_as_the_next_batch():
    """Batching without a child: the round trip is the test's. Each feed's answer comes back to its
    own stream, a feed the child failed on fails alone, and a lost child fails every feed it held."""
    import threading

    process = DecoderProcess(0, [], False, keep=1)  # never spawned
    requests: list[tuple] = []
    in_flight, release = threading.Event(), threading.Event()
    lost = [False]

    def round_trip(request):
        requests.append(request)
        in_flight.set()
        release.wait(10)
        if lost[0]:
            raise DecoderProcessLost("pocketsphinx-0's process died (exit code -9) during this request")
        return [(None, "KeyError: 3") if feed[1] == 3 else (f"heard {feed[1]}", None) for feed in request[2]]

    process._round_trip = round_trip
    process._live_child = lambda: None
    chunk = bytes(640)
    try:
        first = process.queue_feed(0, ("feed", 1, chunk))
        assert in_flight.wait(10)  # the first batch is with the child: the next three gather meanwhile
        later = [process.queue_feed(0, ("feed", stream, chunk)) for stream in (2, 3, 4)]
        release.set()
        assert first.result(10) == "heard 1"
        assert [later[0].result(10), later[2].result(10)] == ["heard 2", "heard 4"]
        with pytest.raises(RuntimeError, match="pocketsphinx: KeyError: 3"):
            later[1].result(10)
        assert [[feed[1] for feed in request[2]] for request in requests] == [[1], [2, 3, 4]]
        assert process.feed_batches == {1: 1, 3: 1}
        lost[0] = True
        gone = [process.queue_feed(0, ("feed", stream, chunk)) for stream in (5, 6)]
        for future in gone:
            with pytest.raises(DecoderProcessLost, match="died"):
                future.result(10)
        # A stream of an earlier child fails at once, without a round trip.
        stale = process.queue_feed(-1, ("feed", 7, chunk))
        with pytest.raises(DecoderProcessLost, match="lost earlier"):
            stale.result(10)
        assert all(feed[1] != 7 for request in requests for feed in request[2])
    finally:
        release.set()
        process.worker.shutdown()


def test_a_streams_open_goes_with_the_next_batch_not_ahead_of_the_feeds():
    """A burst of connects does not queue one round trip per open ahead of the speaking streams'
    feeds: opens queued while a batch is in flight go with the feeds in the next one, and each
    comes back with the generation of the child it opened on."""
    import threading

    process = DecoderProcess(0, [], False, keep=1)  # never spawned: the round trip is the test's
    requests: list[tuple] = []
    in_flight, release = threading.Event(), threading.Event()

    def round_trip(request):
        requests.append(request)
        in_flight.set()
        release.wait(10)
        return [(None, None) for _ in request[2]]

    process._round_trip = round_trip
    process._live_child = lambda: None
    process.generation = 3
    chunk = bytes(640)
    try:
        first = process.queue_feed(3, ("feed", 1, chunk))
        assert in_flight.wait(10)
        opens = [process.queue_open(stream, "40,3,-1") for stream in (2, 3)]
        feed = process.queue_feed(3, ("feed", 1, chunk))
        release.set()
        assert [first.result(10), feed.result(10)] == [None, None]
        assert [future.result(10) for future in opens] == [3, 3]
        assert [[(op, stream) for op, stream, _ in request[2]] for request in requests] == [
            [("feed", 1)], [("open", 2), ("open", 3), ("feed", 1)]]
    finally:
        release.set()
        process.worker.shutdown()


def test_a_stream_needing_a_build_goes_where_none_speaks_or_waits_and_the_builds_are_kept(recognizer):
    """`full` (admission's `decoders` refusal): a stream that finds no idle decoder is let in only
    on a child where no stream is speaking (its decoder, built there between requests, delays no
    speech); while a stream speaks on every child, it is told when to retry. The child keeps what it
    built, and the server's count of its idle decoders says so."""
    chunk = utterance(TEST_PHRASES[0])[4800 : 4800 + 640]
    audio = utterance(TEST_PHRASES[1])

    async def scenario() -> None:
        a, b = recognizer.open(), recognizer.open()  # each child's one decoder
        assert [a.process.name, b.process.name] == ["pocketsphinx-0", "pocketsphinx-1"]
        assert [p.idle for p in recognizer.processes] == [0, 0]
        assert recognizer.full() is None  # nobody speaks: a build delays no speech
        await a.accept(chunk)
        assert recognizer.full() is None and recognizer.least_loaded().name == "pocketsphinx-1"  # a quiet child
        await b.accept(chunk)
        assert recognizer.full() == FULL_RETRY_AFTER_S  # a build would hold a child someone speaks on
        await a.finish()
        assert recognizer.full() is None and recognizer.least_loaded().name == "pocketsphinx-0"
        c = recognizer.open()
        assert c.process.name == "pocketsphinx-0"
        assert await transcribe(c, audio) == TEST_PHRASES[1]  # on the decoder built for it
        await b.finish()
        await asyncio.gather(*(s.close() for s in (a, b, c)))
        assert [(p.decoders, p.idle, p.built) for p in recognizer.processes] == [(2, 2, 1), (1, 1, 0)]
        # Three streams find three idle decoders, two of them on pocketsphinx-0: nothing is built.
        later = [recognizer.open() for _ in range(3)]
        assert [s.process.name for s in later] == ["pocketsphinx-0", "pocketsphinx-1", "pocketsphinx-0"]
        assert await asyncio.gather(*(transcribe(s, audio) for s in later)) == [TEST_PHRASES[1]] * 3
        await asyncio.gather(*(s.close() for s in later))
        assert [p.built for p in recognizer.processes] == [1, 0]

    asyncio.run(scenario())
    assert recognizer.info().details["decoders_built"] == 1


def test_a_session_that_would_need_a_build_beside_speech_on_every_child_is_told_busy():
    """The server (/v1/voice): a child each, one decoder each, a session speaking on each: a third
    is refused `busy` (cause `decoders`, a retry hint), counted, and /readyz says full; once they
    have finished speaking, a session is let in (its decoder built where nobody speaks)."""
    settings = make_settings(asr={"pocketsphinx": {"phrases": TEST_PHRASES, "decoders": 2, "processes": 2}})
    speech = speech_pcm(TEST_PHRASES[1], tail_s=0) + speech_pcm(TEST_PHRASES[2], lead_s=0)  # 4 s of speech
    with running_server(settings) as server:
        processes = server.runtime.recognizer.processes

        async def until(speaking: Callable[[list[int]], bool], what: str) -> None:
            deadline = time.monotonic() + 10
            while not speaking(server.on_loop(lambda: [p.speaking for p in processes])):
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.02)

        async def run() -> tuple[dict, dict, list]:
            async with VoiceClient.connect(server.ws_url) as first, VoiceClient.connect(server.ws_url) as second:
                talks = [asyncio.create_task(client.stream(speech, chunk_ms=20)) for client in (first, second)]
                await until(all, "the sessions' utterances did not reach the recognizer")
                readyz = server.get("/readyz").json()
                async with VoiceClient.connect(server.ws_url, send_start=False) as third:
                    busy = await third.wait_for("error")
                await asyncio.gather(*talks)
                await until(lambda speaking: not any(speaking), "the sessions' utterances did not end")
                async with VoiceClient.connect(server.ws_url) as later:  # session.ready: let in
                    return readyz, busy, later.of_type("session.ready")

        readyz, busy, ready = asyncio.run(run())
        assert readyz["full"] and not readyz["ready"]
        asr = next(engine for engine in readyz["engines"] if engine["kind"] == "asr")
        assert asr["details"]["decoders"] == 2 and asr["details"]["decoders_idle"] == 0
        assert busy["code"] == "busy" and busy["cause"] == "decoders" and busy["retry_after_s"] == FULL_RETRY_AFTER_S
        assert server.metric("voicebot_sessions_refused_total", 'reason="decoders"') == 1
        assert ready
