"""A deadline on every HTTP request head, for the server run by run_server.py.

uvicorn times out a connection only while it is idle between requests (`timeout_keep_alive`,
cancelled by the first byte that comes): one that connects and sends nothing, or sends its headers
a byte at a time (slowloris), stays open for ever, and enough of them exhaust the process's file
descriptors. `HandshakeDeadline` is uvicorn's httptools protocol with one addition: a request head
not complete within `timeout_s` is closed, the first one counted from the connection, each later
one on a keep-alive connection from the end of the response before it. A WebSocket is past its head
before it upgrades, so live sessions are untouched.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HandshakeDeadline(HttpToolsProtocol):
    timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline = self.loop.call_later(self.timeout_s, self._head_too_slow)

    def on_response_complete(self) -> None:
        # Idle now unless a pipelined request (its head already complete) is next.
        idle = not self.pipeline
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._head_deadline.cancel()
            self._head_deadline = self.loop.call_later(self.timeout_s, self._head_too_slow)

    def on_headers_complete(self) -> None:
        self._head_deadline.cancel()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_deadline.cancel()
        super().connection_lost(exc)

    def _head_too_slow(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()


def with_deadline(timeout_s: float) -> type[HandshakeDeadline]:
    """The protocol class for `uvicorn.run(http=...)` with this deadline."""
    return type("HandshakeDeadline", (HandshakeDeadline,), {"timeout_s": timeout_s})
