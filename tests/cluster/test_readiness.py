"""/readyz takes a full server out of a load balancer's pool, and brings it back when a session ends."""

from __future__ import annotations

import asyncio
import time

from tests.conftest import VoiceClient, make_settings, running_server


def test_a_full_server_is_not_ready_until_a_session_ends():
    with running_server(make_settings(server={"max_sessions": 1})) as server:
        assert server.get("/readyz").status_code == 200

        async def full_readiness():
            async with VoiceClient.connect(server.ws_url):
                return await asyncio.to_thread(server.get, "/readyz")

        while_full = asyncio.run(full_readiness())
        for _ in range(200):  # the closed session is released once the server has seen the close
            if not server.runtime.sessions:
                break
            time.sleep(0.02)
        after = server.get("/readyz")
    assert while_full.status_code == 503
    assert while_full.json()["full"] is True and while_full.json()["draining"] is False
    assert while_full.json()["cluster"] is None  # no cluster.redis_url: the server runs alone
    assert after.status_code == 200 and after.json()["full"] is False
