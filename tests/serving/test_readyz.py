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

        async def run():
            async with VoiceClient.connect(srv.ws_url):  # one open session; nothing speaks, nothing steps
                measured = costs.decode
                costs.decode = {1: 10.0}  # what the scheduler would measure on a device far too slow
                refused_before = synth.scheduler.refused
                try:
                    full = srv.get("/readyz")
                    again = srv.get("/readyz")
                    async with websockets.connect(srv.ws_url) as ws:  # admit() refuses it
                        busy = json.loads(await ws.recv())
                finally:
                    costs.decode = measured
                room = srv.get("/readyz")
            return full, again, refused_before, busy, room

        full, again, refused_before, busy, room = asyncio.run(run())
        assert full.status_code == 503 and full.json()["full"] and not full.json()["ready"]
        assert again.json()["full"] and synth.scheduler.refused == refused_before + 1  # the connection, not /readyz
        assert busy["code"] == "busy" and busy["overloaded"] == synth.name and busy["retry_after_s"] > 0
        assert room.status_code == 200 and not room.json()["full"]
