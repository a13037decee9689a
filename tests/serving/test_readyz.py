"""/readyz answers `full` (503) while the synthesizer's scheduler would refuse one more session,
without counting that question as a refusal; a session let in then is refused the same way."""

from __future__ import annotations

import asyncio
import json

import websockets

from bench.serve import make_model_and_voice
from tests.conftest import VoiceClient, make_settings, running_server


def test_readyz_is_full_while_the_synthesizer_has_no_room(tmp_path):
    model_dir, voices = make_model_and_voice(tmp_path)
    settings = make_settings(tts={"engine": "cosyvoice2", "voice": "bench", "cosyvoice2": {
        "model": str(model_dir), "voices_dir": str(voices), "voice_cache_dir": str(tmp_path / "cache"), "device": "cpu",
        "kv_cache_tokens": 512}})
    with running_server(settings) as srv:
        synth = srv.runtime.synthesizer
        costs = synth.scheduler.costs
        assert srv.get("/readyz").status_code == 200

        def measured(decode_step_s: float, render_per_audio_s: float) -> None:
            """What the scheduler would have measured on a device this fast (set while nothing steps)."""
            costs.decode, costs.render_per_audio_s = {1: decode_step_s}, render_per_audio_s

        async def run():
            async with VoiceClient.connect(srv.ws_url):  # one open session; nothing speaks, nothing steps
                saved = costs.decode, costs.render_per_audio_s
                try:
                    measured(0.001, 0.01)  # room for every slot
                    before = srv.get("/readyz")
                    measured(10.0, 0.01)  # one step longer than a second: nothing more is real time
                    refused_before = synth.scheduler.refused
                    full = srv.get("/readyz")
                    again = srv.get("/readyz")
                    async with websockets.connect(srv.ws_url) as ws:  # admit() refuses it
                        busy = json.loads(await ws.recv())
                    measured(0.001, 0.01)
                    room = srv.get("/readyz")
                finally:
                    costs.decode, costs.render_per_audio_s = saved
            return before, full, again, refused_before, busy, room

        before, full, again, refused_before, busy, room = asyncio.run(run())
        assert before.status_code == 200 and not before.json()["full"]
        assert full.status_code == 503 and full.json()["full"] and not full.json()["ready"]
        assert again.json()["full"] and synth.scheduler.refused == refused_before + 1  # the connection, not /readyz
        assert busy["code"] == "busy" and busy["overloaded"] == synth.name and busy["retry_after_s"] > 0
        assert room.status_code == 200 and not room.json()["full"]
