"""SIGTERM (issue 12, item 9): open sessions get `shutting_down` and close 1001 as documented (not
uvicorn's 1012), and run_server.py exits 0 (it died of the re-raised SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal

import websockets

from tests.conftest import make_settings, start_server_process
from voicebot.runtime import Runtime
from voicebot.protocol import CloseCode, ErrorCode


def test_sigterm_closes_sessions_with_1001_and_exits_0(tmp_path):
    proc, port = start_server_process(tmp_path, {"shutdown_timeout_s": 5})
    try:

        async def session_at_sigterm() -> tuple[list[dict], int | None]:
            async with websockets.connect(f"ws://127.0.0.1:{port}/v1/voice") as ws:
                # The client offers permessage-deflate; run_server.py's server declines it (no
                # compression of every PCM frame on the loop).
                assert ws.response.headers.get("Sec-WebSocket-Extensions") is None
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


def test_drain_wakes_when_the_last_session_leaves_and_gives_up_at_its_timeout():
    """The drain waits on the runtime's news (a reply ended, a session left), not on a poll."""
    rt = Runtime(make_settings())
    rt.sessions.update({"a": object(), "b": object()})

    async def drain() -> tuple[bool, bool, bool]:
        waiting = asyncio.create_task(rt.wait_until(lambda: not rt.sessions, timeout_s=10))
        await asyncio.sleep(0)
        rt.session_left("a")
        await asyncio.sleep(0)
        still_waiting = not waiting.done()
        rt.session_left("b")
        emptied = await asyncio.wait_for(waiting, 1)
        rt.sessions["c"] = object()
        return still_waiting, emptied, await rt.wait_until(lambda: not rt.sessions, timeout_s=0.05)

    assert asyncio.run(drain()) == (True, True, False)
