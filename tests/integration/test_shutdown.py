"""SIGTERM on a real server process: no new sessions, the reply in progress finishes, then exit."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess

import websockets

from tests.conftest import VoiceClient, start_server_process


def test_sigterm_lets_the_reply_finish_and_refuses_new_sessions(tmp_path):
    proc, port = start_server_process(tmp_path, {"shutdown_timeout_s": 20}, stdout=subprocess.PIPE)
    try:
        url = f"ws://127.0.0.1:{port}/v1/voice"

        async def talk():
            async with VoiceClient.connect(url) as client:
                await client.send({"type": "say", "text": "A reply of a few seconds that must be heard to its end, even though the server is stopping."})
                start = await client.wait_for("audio.start")
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                async with websockets.connect(url) as late:
                    refusal = json.loads(await late.recv())
                end = await client.wait_for("audio.end")
                return start, end, refusal, client

        start, end, refusal, client = asyncio.run(talk())
        assert end["reply_id"] == start["reply_id"]
        assert len(client.reply_frames(end["reply_id"])) == end["frames"]
        assert refusal["code"] == "shutting_down"
        # uvicorn re-raises the signal it handled once it has stopped, so the exit status says SIGTERM.
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert b"drained: 0 replies still in progress" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
