"""pocketsphinx's decoding processes (voicebot/asr/pocketsphinx_process.py): streams bound to a
child for their life, a child that dies replaced and its streams told, no child left after close."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.audio import espeak_speech
from tests.conftest import TEST_PHRASES, VoiceClient, make_settings, running_server, speech_pcm
from voicebot.asr.pocketsphinx import PocketsphinxRecognizer
from voicebot.asr.pocketsphinx_process import DecoderProcessLost
from voicebot.config import PocketsphinxConfig


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
        assert victim.lost == 1 and victim.pid not in (None, old_pid) and gone(old_pid)
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
    assert victim.lost == 1 and victim.pid != old_pid


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
    code = ("from voicebot.asr.pocketsphinx import PocketsphinxRecognizer; from voicebot.config import PocketsphinxConfig; "
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
        assert process.lost == 1
        pid = process.pid
    assert gone(pid)
