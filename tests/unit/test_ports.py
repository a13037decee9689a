"""The test servers' ports: none can be handed to two servers at once (two xdist workers)."""

from __future__ import annotations

import errno
import socket

import pytest

from tests.conftest import free_port, make_settings


def test_a_free_port_is_handed_to_no_one_else_and_its_server_can_still_bind_it():
    port = free_port()
    with socket.socket() as other, pytest.raises(OSError) as refused:
        other.bind(("127.0.0.1", port))  # another process asking for it by number
    assert refused.value.errno == errno.EADDRINUSE
    ephemeral = set()
    for _ in range(2000):  # another process asking for any port (its bind(0)) is never given it
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            ephemeral.add(other.getsockname()[1])
    assert port not in ephemeral
    with socket.socket() as server:  # as uvicorn, redis-server and HAProxy bind theirs
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            server.accept()[0].close()


def test_an_in_process_server_binds_a_port_of_its_own():
    assert make_settings().server.port == 0  # running_server reads back the port the kernel chose
