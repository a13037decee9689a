"""SIGTERM (issue 12, item 9): open sessions get `shutting_down` and close 1001 as documented (not
uvicorn's 1012), and run_server.py exits 0 (it died of the re-raised SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time

import httpx
import websockets
import yaml

from tests.conftest import free_port
from voicebot.config import REPO_ROOT
from voicebot.protocol import CloseCode, ErrorCode


def test_sigterm_closes_sessions_with_1001_and_exits_0(tmp_path):
    port = free_port()
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": port, "shutdown_timeout_s": 5}}))
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "run_server.py"), "--config", str(config)], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)

        async def session_at_sigterm() -> tuple[list[dict], int | None]:
            async with websockets.connect(f"ws://127.0.0.1:{port}/v1/voice") as ws:
                await ws.send(json.dumps({"type": "session.start"}))
                events = [json.loads(await ws.recv())]
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(websockets.ConnectionClosed):
                    while True:
                        events.append(json.loads(await asyncio.wait_for(ws.recv(), 20)))
                return events, ws.close_code

        events, close_code = asyncio.run(session_at_sigterm())
        assert events[0]["type"] == "session.ready"
        assert events[-1]["type"] == "error" and events[-1]["code"] == ErrorCode.SHUTTING_DOWN
        assert close_code == CloseCode.GOING_AWAY
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
