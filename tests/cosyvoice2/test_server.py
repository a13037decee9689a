"""The real server with tts.engine: cosyvoice2 (tiny fixture model), over a real WebSocket."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import VoiceClient, make_settings, running_server
from tiny_frontend import make_model_dir
from voicebot.tts.cosyvoice2 import synthesizer as synthesizer_mod

TOKENS = 40  # speech tokens per utterance: 40 x 40 ms = 1.6 s of audio


@pytest.fixture
def fixed_length(monkeypatch):
    """Random tiny weights may stop at once; decode exactly TOKENS tokens so audio is certain."""

    def sampler(*_args):
        def sample(logp, history):
            eos = logp.shape[-1] - 3
            # eos only where the program allows it (bistream bans it while text is still coming in)
            stop = len(history) >= TOKENS and logp[eos] > -float("inf")
            return eos if stop else int(logp[:eos].argmax())

        return sample

    monkeypatch.setattr(synthesizer_mod.RasSampler, "from_hparams", sampler)


def test_say_is_spoken_in_200_ms_frames_and_reset_rebuilds_state(tmp_path, cv2_dir, fixed_length):
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
        assert srv.get("/readyz").json()["ready"]
        assert "anna" in [v["name"] for v in srv.get("/v1/voices").json()["voices"]]

        async def talk():
            async with VoiceClient.connect(srv.ws_url) as client:
                await client.send({"type": "say", "text": "Hello there."})
                first = await client.wait_for("audio.end", timeout=120)
                await client.wait_for("state.reset", timeout=30)
                await client.send({"type": "say", "text": "Hello again."})
                second = await client.wait_for("audio.end", count=2, timeout=120)
                return client, first, second

        client, first, second = asyncio.run(talk())
        for end in (first, second):
            frames = client.reply_frames(end["reply_id"])
            assert len(frames) == end["frames"] and all(len(f) == 9600 for f in frames[:-1])
            assert end["samples"] == TOKENS * 960  # 960 samples at 24 kHz per speech token
        reset = client.of_type("state.reset")[0]
        cv2_report = next(e for e in reset["engines"] if e["engine"] == "cosyvoice2")
        assert cv2_report["generation"] >= 1 and cv2_report["bytes_freed"] > 0
