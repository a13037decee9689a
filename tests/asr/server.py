"""The real app on 127.0.0.1 with no warm-up session (so a server with a token can be started too)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from tests.conftest import bound_port
from voicebot.app import create_app
from voicebot.config import Settings


@contextlib.contextmanager
def serve(settings: Settings, **uvicorn_options) -> Iterator[int]:
    """Run the app in a thread until the block ends; yields its port. Options go to uvicorn.Config."""
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.server.port,
                                           log_level="warning", **uvicorn_options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield bound_port(server)
    finally:
        server.should_exit = True
        thread.join(10)
