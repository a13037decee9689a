"""The optional shared token, checked on every WebSocket before anything else happens on it.

A client presents it in one of three ways, so that every kind of client has one it can use:
- `?token=` in the URL: the only one the OBS plugin (a URL field) can use; it shows in access logs.
- the subprotocol `token.<TOKEN>` next to `voicebot`: what the pages use, since a browser can set
  no headers on a WebSocket; the server answers with `voicebot`.
- `Authorization: Bearer <TOKEN>`: for programs (the reference client).

A FunASR client cannot present a token at all: `required_token` lets the FunASR paths go without
it for clients in `server.funasr_tokenless_networks`.

Also here, the rest of what an exposed server needs (docs/security.md): `check_exposure` refuses
a server bound beyond loopback with no token (unless `server.allow_anonymous`), the Origin check
stops any web page a user visits from driving the server (cross-site WebSocket hijacking), and
`hide_tokens_in_logs` keeps `?token=` out of uvicorn's access and connection logs.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import re
from urllib.parse import urlsplit

from starlette.websockets import WebSocket

from voicebot import protocol
from voicebot.config import ConfigError, ServerConfig
from voicebot.metrics import Metrics
from voicebot.protocol import CloseCode, ErrorCode

log = logging.getLogger("voicebot.auth")

SUBPROTOCOL = "voicebot"
TOKEN_PREFIX = "token."


def presented_token(ws: WebSocket) -> str | None:
    if token := ws.query_params.get("token"):
        return token
    for offered in ws.scope.get("subprotocols", []):
        if offered.startswith(TOKEN_PREFIX):
            return offered[len(TOKEN_PREFIX) :]
    scheme, _, credentials = ws.headers.get("authorization", "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None


def required_token(server: ServerConfig, ws: WebSocket, funasr: bool) -> str | None:
    """The token this connection must present: none for a FunASR client from one of
    `server.funasr_tokenless_networks` (FunASR's clients have no way to send one, docs/funasr.md)."""
    if funasr and server.funasr_tokenless_networks and ws.client is not None:
        with contextlib.suppress(ValueError):  # a client that is not an IP address (a Unix socket)
            address = ipaddress.ip_address(ws.client.host)
            address = getattr(address, "ipv4_mapped", None) or address  # an IPv4 client of a dual-stack socket
            if any(address in network for network in server.funasr_tokenless_networks):
                return None
    return server.token


async def accept(ws: WebSocket, token: str | None, metrics: Metrics, allowed_origins: list[str] = ()) -> bool:
    """Accept the connection; if its Origin is not allowed or the token is wrong, say so and
    close it (False)."""
    # A browser that offered subprotocols fails the connection unless the server picks one.
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in ws.scope.get("subprotocols", []) else None)
    if not origin_allowed(ws.headers.get("origin"), ws.headers.get("host"), allowed_origins):
        await _refuse(ws, metrics, ErrorCode.FORBIDDEN_ORIGIN, f"web pages from {ws.headers['origin'][:100]!r} may not connect",
                      CloseCode.POLICY, "origin not allowed")
        return False
    presented = presented_token(ws)
    if token is None or (presented is not None and hmac.compare_digest(presented.encode(), token.encode())):
        return True
    await _refuse(ws, metrics, ErrorCode.UNAUTHORIZED, "missing or wrong token", CloseCode.UNAUTHORIZED, "unauthorized")
    return False


async def _refuse(ws: WebSocket, metrics: Metrics, code: str, message: str, close_code: int, reason: str) -> None:
    metrics.sessions_refused.labels(code).inc()
    metrics.errors.labels(code).inc()
    with contextlib.suppress(Exception):
        await ws.send_json(protocol.error(code, message))
        await ws.close(close_code, reason)


def origin_allowed(origin: str | None, host: str | None, allowed_origins: list[str]) -> bool:
    """No Origin (not a browser), the server's own pages, or one of `allowed_origins`."""
    if origin is None or "*" in allowed_origins or origin.rstrip("/") in (o.rstrip("/") for o in allowed_origins):
        return True
    return host is not None and urlsplit(origin).netloc.lower() == host.lower()


def check_exposure(server: ServerConfig) -> None:
    """Refuse a server reachable from the network with no token, unless explicitly allowed."""
    if server.token is not None or _loopback(server.host):
        return
    if not server.allow_anonymous:
        raise ConfigError(
            f"server.host {server.host!r} is reachable from the network and server.token is not set: anyone could "
            "use the server and its overlay. Set a token (VOICEBOT_SERVER__TOKEN), bind 127.0.0.1, or set "
            "server.allow_anonymous: true (docs/security.md)"
        )
    log.warning("server.allow_anonymous: %s is open to anyone who can reach it, with no token", server.host)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


_TOKEN_IN_URL = re.compile(r"(token=)[^&\s\"']+")


class _HideTokens(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "token=" in message:
            record.msg, record.args = _TOKEN_IN_URL.sub(r"\1<hidden>", message), ()
        return True


def hide_tokens_in_logs() -> None:
    """uvicorn logs every request and WebSocket with its query string: `?token=` would be in it."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HideTokens) for f in logger.filters):
            logger.addFilter(_HideTokens())
