"""Fixtures for the responder tests: one local chat-completions server per test session."""

from __future__ import annotations

import pytest

from tests.reply.sse_server import SSEServer


@pytest.fixture(scope="session")
def sse_server_instance():
    server = SSEServer().start()
    yield server
    server.stop()


@pytest.fixture
def sse(sse_server_instance: SSEServer) -> SSEServer:
    """The server, with an empty plan and no recorded requests."""
    sse_server_instance.reset()
    return sse_server_instance
