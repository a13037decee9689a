"""Per-client-address limits: how many WebSockets and sessions one address may hold at once.

The address is the ASGI scope's `client`: the socket's peer or, where the peer is one of
`server.trusted_proxies`, the client that proxy names in X-Forwarded-For (uvicorn's
ProxyHeadersMiddleware, which `install` puts in front; the header of any other peer is ignored).
`CountConnections` counts every WebSocket for the whole time its route runs, whatever the route;
`admit()` (voicebot/app.py) asks `refusal` whether one more is allowed and `hold_session` for
each connection it admits as a session, released with the connection. An HTTP request that runs
an engine (voicebot/frontends/openai_audio/) is a session of its address too, from admission to its last
byte: `refusal(scope, session=True)`, then `take_session` and `release_session`.
"""

from __future__ import annotations

from collections import Counter

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from voicebot.config.server import ServerConfig

_HOLDS_SESSION = "voicebot.holds_session"  # scope key: this connection counts as a session of its address


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return client[0] if client else "unknown"


class ClientLimits:
    """Open connections and sessions per address; an address with none has no entry."""

    def __init__(self, max_connections: int | None, max_sessions: int | None) -> None:
        self.max_connections = max_connections
        self.max_sessions = max_sessions
        self.connections: Counter[str] = Counter()
        self.sessions: Counter[str] = Counter()

    def refusal(self, scope: Scope, session: bool) -> str | None:
        """Why this connection (already counted) is one too many for its address, or None."""
        address = client_address(scope)
        if self.max_connections is not None and self.connections[address] > self.max_connections:
            return f"{address} has {self.max_connections} connections open, this server's limit per client address"
        if session and self.max_sessions is not None and self.sessions[address] >= self.max_sessions:
            return f"{address} has {self.max_sessions} sessions open, this server's limit per client address"
        return None

    def hold_session(self, scope: Scope) -> None:
        """Count a WebSocket as a session of its address until it closes."""
        self.take_session(scope)
        scope[_HOLDS_SESSION] = True

    def take_session(self, scope: Scope) -> str:
        """Count one session for this address; its holder calls release_session(address) once."""
        address = client_address(scope)
        self.sessions[address] += 1
        return address

    def release_session(self, address: str) -> None:
        _decrement(self.sessions, address)

    def opened(self, scope: Scope) -> None:
        self.connections[client_address(scope)] += 1

    def closed(self, scope: Scope) -> None:
        address = client_address(scope)
        _decrement(self.connections, address)
        if scope.pop(_HOLDS_SESSION, False):
            _decrement(self.sessions, address)


def _decrement(counts: Counter[str], address: str) -> None:
    counts[address] -= 1
    if counts[address] <= 0:
        del counts[address]


class CountConnections:
    """ASGI middleware: each WebSocket counts for its address until its route returns."""

    def __init__(self, app: ASGIApp, limits: ClientLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        self.limits.opened(scope)
        try:
            await self.app(scope, receive, send)
        finally:
            self.limits.closed(scope)


def install(app: FastAPI, server: ServerConfig) -> ClientLimits:
    """Count connections per client address, the address resolved as the module docstring says."""
    limits = ClientLimits(server.max_connections_per_client, server.max_sessions_per_client)
    app.add_middleware(CountConnections, limits=limits)
    # Added last, so it runs first: the address is resolved before anything counts it.
    app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=[str(net) for net in server.trusted_proxies])
    return limits
