"""pocketsphinx decoders are borrowed and given back, not built and freed per session (issue 12,
item 7: 90 MB of RSS kept per concurrent session). The pool is the same wherever it lives: these run
it in the test's process (`processes: 0`, the server's threads), and what the streams see on both
paths; tests/asr/test_pocketsphinx_process.py has the decoding processes' own."""

from __future__ import annotations

import asyncio
import platform

import numpy as np
import pytest

from tests.audio import espeak_speech
from tests.conftest import TEST_PHRASES
from voicebot.asr import pocketsphinx_decoders
from voicebot.asr.pocketsphinx import PocketsphinxRecognizer
from voicebot.asr.pocketsphinx_decoders import Decoders
from voicebot.config.engines import PocketsphinxConfig


@pytest.fixture(scope="module")
def recognizer():
    engine = PocketsphinxRecognizer(PocketsphinxConfig(phrases=TEST_PHRASES, decoders=2, processes=0))
    engine.load()
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=[0, 1], ids=["threads", "processes"])
def either_recognizer(request):
    """The same streams, their decoders on the server's threads or in a decoding process."""
    engine = PocketsphinxRecognizer(PocketsphinxConfig(phrases=TEST_PHRASES, decoders=2, processes=request.param))
    engine.load()
    yield engine
    engine.close()


async def transcribe(stream, audio: np.ndarray) -> str:
    for i in range(0, len(audio), 1600):
        await stream.accept(audio[i : i + 1600])
    return (await stream.finish()).text


def test_the_pool_built_at_start_up_serves_as_many_streams_at_once_and_keeps_that_many(monkeypatch):
    pool = 3
    engine = PocketsphinxRecognizer(PocketsphinxConfig(phrases=TEST_PHRASES, decoders=pool, processes=0))
    engine.load()
    assert engine.decoders.idle == pool
    built = []
    new_decoder = engine.decoders.new_decoder
    monkeypatch.setattr(engine.decoders, "new_decoder", lambda: built.append(1) or new_decoder())
    audio = np.concatenate([np.zeros(4800, np.float32), espeak_speech(TEST_PHRASES[0]), np.zeros(8000, np.float32)])

    async def round_of(n: int) -> list[str]:
        streams = [engine.open() for _ in range(n)]
        texts = await asyncio.gather(*(transcribe(s, audio) for s in streams))
        await asyncio.gather(*(s.close() for s in streams))
        return texts

    try:
        for _ in range(3):
            assert asyncio.run(round_of(pool)) == [TEST_PHRASES[0]] * pool
            assert engine.decoders.idle == pool
        assert built == []  # no stream waited for a build, and the loop for none
        # More streams than the pool: the others build theirs; those given back beyond the pool are freed.
        assert asyncio.run(round_of(pool + 2)) == [TEST_PHRASES[0]] * (pool + 2)
        assert len(built) >= 2
        assert engine.decoders.idle == pool
    finally:
        engine.close()


def test_a_reset_decoder_decodes_like_a_new_one(recognizer):
    audio = np.concatenate([np.zeros(4800, np.float32), espeak_speech(TEST_PHRASES[2]), np.zeros(8000, np.float32)])

    async def scenario() -> tuple[str, str, int]:
        first = recognizer.open()
        first_text = await transcribe(first, audio)
        held = first._transcriber.result().decoder
        report = await first.reset()
        # Renewed in place, not given back (and perhaps freed, and another built: that keeps the GIL
        # for 0.3 s or more, and the event loop waits).
        assert first._transcriber.result().decoder is held
        again = await transcribe(first, audio)
        await first.close()
        return first_text, again, report.generation

    first_text, again, generation = asyncio.run(scenario())
    assert first_text == again == TEST_PHRASES[2]
    assert generation == 1


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_memory_is_handed_back_on_glibc():
    assert pocketsphinx_decoders.release_freed_memory()


@pytest.mark.parametrize("second_pass", [False, True])
def test_the_general_lms_second_pass_runs_only_when_configured(second_pass):
    """What runs at end_utt is latency: the flat second pass (~180 ms of CPU, no better words on the
    turn set) only when asked for; the best path (~14 ms, better words without that pass) always."""
    decoder = Decoders([], second_pass, 1, build_later=lambda build: None).new_decoder()
    assert decoder.config["bestpath"] is True
    assert decoder.config["fwdflat"] is second_pass


def test_a_grammar_decoder_finds_its_phrase_without_the_lattice(either_recognizer):
    decoder = Decoders(TEST_PHRASES, False, 1, build_later=lambda build: None).new_decoder()
    assert decoder.config["bestpath"] is False
    audio = np.concatenate([np.zeros(4800, np.float32), espeak_speech(TEST_PHRASES[1]), np.zeros(8000, np.float32)])

    async def scenario() -> str:
        stream = either_recognizer.open()
        try:
            return await transcribe(stream, audio)
        finally:
            await stream.close()

    assert asyncio.run(scenario()) == TEST_PHRASES[1]


def test_partials_are_searched_at_most_once_per_interval_and_the_final_is_whole(either_recognizer):
    """hyp() holds the GIL: a partial at most every PARTIAL_INTERVAL_SAMPLES of audio, not per chunk."""
    chunk = 640  # 40 ms, as the server feeds it
    per_partial = pocketsphinx_decoders.PARTIAL_INTERVAL_SAMPLES // chunk
    audio = np.concatenate([np.zeros(4800, np.float32), espeak_speech(TEST_PHRASES[3]), np.zeros(8000, np.float32)])

    async def scenario() -> tuple[list[int], list[str], str]:
        stream = either_recognizer.open()
        try:
            at, texts = [], []
            for index, start in enumerate(range(0, len(audio), chunk)):
                partial = await stream.accept(audio[start : start + chunk])
                if partial is not None:
                    at.append(index)
                    texts.append(partial)
            return at, texts, (await stream.finish()).text
        finally:
            await stream.close()

    at, texts, final = asyncio.run(scenario())
    assert texts, "no partial at all"
    assert all((index + 1) % per_partial == 0 for index in at), at
    assert final == TEST_PHRASES[3]


def utterance_pcm16(phrase: str) -> bytes:
    audio = np.concatenate([np.zeros(4800, np.float32), espeak_speech(phrase), np.zeros(8000, np.float32)])
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def test_a_burst_of_opens_beyond_the_pool_builds_between_requests_not_in_them(monkeypatch):
    """The decoding process's loop (`serve`, here on a thread over a real pipe): an open that finds
    no idle decoder is answered without a build, so a speaking stream's feed queued behind a burst of
    opens is answered before any of their decoders is built; the waiting streams' decoders are built
    between requests, their audio held meanwhile and decoded whole."""
    import threading
    from multiprocessing import Pipe

    events: list[str] = []  # what the child did, in order: a build, a feed answered
    new_decoder, feed = Decoders.new_decoder, pocketsphinx_decoders.Transcriber.feed
    monkeypatch.setattr(Decoders, "new_decoder", lambda pool: events.append("build") or new_decoder(pool))
    monkeypatch.setattr(pocketsphinx_decoders.Transcriber, "feed",
                        lambda stream, pcm: events.append("feed") or feed(stream, pcm))
    monkeypatch.setattr(pocketsphinx_decoders.signal, "signal", lambda *args: None)  # a thread's, not a process's
    ours, theirs = Pipe()
    chunk = bytes(640)

    def answer():
        assert ours.poll(60), "the child's loop stopped answering"
        return ours.recv()

    # Queued before the child reads any: stream 1 takes the one idle decoder, 2 and 3 find none,
    # then stream 1 speaks (as the server's worker sends them during a burst of connects).
    for request in [("open", 1, None), ("open", 2, None), ("open", 3, None), ("feed", 1, chunk)]:
        ours.send(request)
    child = threading.Thread(target=pocketsphinx_decoders.serve, args=(theirs, TEST_PHRASES, False, 1))
    child.start()
    try:
        assert answer() == ("ready", None)
        # events[0] is the start-up's build (keep=1), done before "ready"; the child's loop goes on
        # at once, so what follows is read from there, not cleared (a clear could land after it).
        answers = [answer() for _ in range(4)]
        assert [(result, error) for result, error, _, _ in answers] == [(None, None)] * 4
        assert events[:2] == ["build", "feed"]  # stream 1's feed waited for no build
        pcm = utterance_pcm16(TEST_PHRASES[0])
        for start in range(0, len(pcm), 1280):
            ours.send(("batch", None, [("feed", 2, pcm[start : start + 1280])]))
            answer()
        ours.send(("finish", 2, None))
        (text, _), error, _, _ = answer()
        assert error is None and text == TEST_PHRASES[0]
        # Stream 2's decoder, once; stream 3's too unless the child had no gap between requests for
        # it yet (then its close frees it of the wait): one build per waiting stream at most.
        assert events[1:].count("build") in (1, 2)
        for stream in (1, 2, 3):
            ours.send(("close", stream, None))
            assert answer()[1] is None
    finally:
        ours.close()
        child.join(30)
    assert not child.is_alive()  # it returns when its pipe closes


def test_a_stream_waiting_for_its_decoder_holds_at_most_the_bound_then_builds_its_own(monkeypatch):
    monkeypatch.setattr(pocketsphinx_decoders, "MAX_HELD_BYTES", 6400)  # 0.2 s
    pool = Decoders(TEST_PHRASES, False, 1, build_later=None)
    stream = pocketsphinx_decoders.Transcriber(pool, pool.take_idle())
    assert stream.decoder is None  # nothing loaded: none idle, and none built
    pcm = utterance_pcm16(TEST_PHRASES[1])
    stream.feed(pcm[:6400])
    assert stream.decoder is None  # held, within the bound
    stream.feed(pcm[6400:7040])
    assert stream.decoder is not None  # past it: its own, and the held audio decoded on it
    stream.feed(pcm[7040:])
    assert stream.finish() == TEST_PHRASES[1]
    stream.close()
    assert pool.idle == 1


def test_decoders_built_for_streams_beyond_the_pool_are_kept_for_the_next_burst(monkeypatch):
    """The decoding process's loop over a real pipe: streams beyond its pool get decoders built
    between requests, each answer telling the server how many since the last; given back, they are
    kept (the pool grows to the most streams bound at once), so the next burst as large builds none
    (each build holds the child, and every stream speaking there, for 0.2-0.6 s)."""
    import threading
    import time
    from multiprocessing import Pipe

    monkeypatch.setattr(pocketsphinx_decoders.signal, "signal", lambda *args: None)  # a thread's, not a process's
    ours, theirs = Pipe()
    child = threading.Thread(target=pocketsphinx_decoders.serve, args=(theirs, TEST_PHRASES, False, 1))
    child.start()
    built = 0  # as the answers told

    def ask(request: tuple):
        nonlocal built
        ours.send(request)
        assert ours.poll(60), "the child's loop stopped answering"
        result, error, _, told = ours.recv()
        assert error is None
        built += told
        return result

    pcm = utterance_pcm16(TEST_PHRASES[2])
    try:
        assert ours.poll(60) and ours.recv() == ("ready", None)
        for _ in range(2):
            for stream in (1, 2, 3):
                ask(("open", stream, None))
            deadline = time.monotonic() + 30
            while built < 2:  # streams 2 and 3 wait for theirs, built between requests
                ask(("batch", None, []))
                assert time.monotonic() < deadline, "the waiting streams' decoders were not built"
            ask(("batch", None, [("feed", 3, pcm)]))
            text, _ = ask(("finish", 3, None))
            assert text == TEST_PHRASES[2]
            for stream in (1, 2, 3):
                ask(("close", stream, None))
        assert built == 2  # the second burst found the first's decoders idle
    finally:
        ours.close()
        child.join(30)
    assert not child.is_alive()
