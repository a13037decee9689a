"""The voice-derivation thread of CosyVoice 2 outlives what is raised in it, on the real server
(tiny fixture model) over a real WebSocket: a derivation that raises SystemExit skips that one
reset (the voice keeps its state and speaks), a thread that dies is replaced, and the next reset
derives again."""

from __future__ import annotations

import asyncio
import ctypes
import threading

import numpy as np
import pytest
import soundfile as sf
from test_engine import make_synth
from test_server import TOKENS, fixed_length  # noqa: F401 (a fixture: usefixtures below)
from tiny_frontend import make_model_dir

from tests.conftest import VoiceClient, make_settings, running_server


def _exit_once(monkeypatch, synth) -> list[str]:
    """The voice derivation raises SystemExit the first time (a library calling exit()); the names asked for."""
    derive, calls = synth.voice_prompts.derive, []

    def exits_once(name):
        calls.append(name)
        if len(calls) == 1:
            raise SystemExit("a library called exit()")
        return derive(name)

    monkeypatch.setattr(synth.voice_prompts, "derive", exits_once)
    return calls


def _kill(thread: threading.Thread) -> None:
    """Raise SystemExit in `thread` (at its next Python instruction), as tests/integration/test_faults.py does."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread killed on purpose
@pytest.mark.usefixtures("fixed_length")
def test_a_failed_or_lost_voice_derivation_skips_one_reset_and_the_voice_keeps_speaking(tmp_path, cv2_dir, monkeypatch):
    voices = tmp_path / "voices"
    voices.mkdir()
    t = np.arange(2 * 24000) / 24000
    sf.write(voices / "anna.wav", (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24000, subtype="FLOAT")
    (voices / "anna.txt").write_text("Hello world.")
    settings = make_settings(
        tts={"engine": "cosyvoice2", "voice": "anna", "cosyvoice2": {
            "model": str(make_model_dir(tmp_path / "model", cv2_dir)), "voices_dir": str(voices),
            "voice_cache_dir": str(tmp_path / "cache"), "device": "cpu", "kv_cache_tokens": 512}},
        reset={"interval_s": 1.0},
    )
    with running_server(settings) as srv:
        synth = srv.runtime.synthesizer
        calls = _exit_once(monkeypatch, synth)
        lost = 'worker="cosyvoice2-voices"'
        lost_before = srv.metric("voicebot_worker_threads_lost_total", lost)

        async def talk():
            async with VoiceClient.connect(srv.ws_url) as client:
                voice_state = synth.library["anna"]
                await client.send({"type": "say", "text": "Hello there."})
                await client.wait_for("audio.end", timeout=120)
                await client.wait_for("state.reset", timeout=30)  # its derivation exits
                kept = synth.library["anna"] is voice_state
                await client.send({"type": "say", "text": "Hello again."})
                await client.wait_for("audio.end", count=2, timeout=120)
                await client.wait_for("state.reset", count=2, timeout=60)  # derives again
                threads = [thread for thread in synth.voice_worker._live if thread.is_alive()]
                for thread in threads:
                    _kill(thread)  # idle: it dies as it takes the next derivation
                await client.send({"type": "say", "text": "Still here."})
                await client.wait_for("audio.end", count=3, timeout=120)
                await client.wait_for("state.reset", count=3, timeout=60)  # on the replacement thread
                return client, kept, threads

        client, kept, killed = asyncio.run(talk())
        assert srv.thread.is_alive() and srv.get("/healthz").status_code == 200
        assert kept and not client.of_type("error")
        ends = client.of_type("audio.end")
        assert len(ends) == 3 and all(end["samples"] == TOKENS * 960 for end in ends)
        resets = client.of_type("state.reset")[:3]
        # The first reset renewed the recognizer only: the voice is named as skipped, not reported reset.
        assert [[e["engine"] for e in reset["engines"]] for reset in resets] == [["pocketsphinx"], ["pocketsphinx", "cosyvoice2"], ["pocketsphinx", "cosyvoice2"]]
        assert [reset["skipped"] for reset in resets] == [["cosyvoice2"], [], []]
        reports = [reset["engines"][1] for reset in resets[1:]]
        assert [(r["generation"], r["bytes_freed"] > 0) for r in reports] == [(1, True), (2, True)]
        assert len(calls) >= 3 and synth.info().details["voice_refreshes_failed"] == 1
        assert srv.metric("voicebot_voice_refreshes_failed_total") == 1
        assert srv.metric("voicebot_resets_skipped_total", 'engine="cosyvoice2"') == 1
        assert killed and all(not thread.is_alive() for thread in killed)
        assert srv.metric("voicebot_worker_threads_lost_total", lost) == lost_before + len(killed)


def test_sessions_sharing_a_failed_derivation_all_skip_their_reset(tmp_path, cv2_dir, monkeypatch):
    synth = make_synth(tmp_path, cv2_dir)
    calls = _exit_once(monkeypatch, synth)

    async def run():
        a, b = synth.open("anna"), synth.open("anna")
        voice_state = synth.library["anna"]
        skipped = await asyncio.gather(a.reset(), b.reset())  # one derivation, shared, that exits
        kept = synth.library["anna"] is voice_state
        renewed = await a.reset()
        await a.close()
        await b.close()
        return skipped, kept, renewed, synth.library["anna"] is voice_state

    try:
        skipped, kept, renewed, still_old = asyncio.run(run())
    finally:
        synth.close()
    assert [(r.generation, r.bytes_freed, r.skipped) for r in skipped] == [(0, 0, True), (0, 0, True)] and kept
    assert renewed.generation == 1 and renewed.bytes_freed > 0 and not renewed.skipped and not still_old
    assert calls == ["anna", "anna"] and synth.info().details["voice_refreshes_failed"] == 1
