"""The optional shared token, checked on every WebSocket before anything else happens on it.

A client presents it in one of three ways, so that every kind of client has one it can use:
- `?token=` in the URL: the only one the OBS plugin (a URL field) can use; it shows in access logs.
- the subprotocol `token.<TOKEN>` next to `voicebot`: what the pages use, since a browser can set
  no headers on a WebSocket; the server answers with `voicebot`.
- `Authorization: Bearer <TOKEN>`: for programs (the reference client).

A FunASR client cannot present a token at all: `required_token` lets the FunASR paths go without
it for clients in `server.funasr_tokenless_networks`.

Also here, the rest of what an exposed server needs (docs/security.md): `check_exposure` refuses
a server bound beyond loopback with no token (unless `server.allow_anonymous`); `CheckHost` refuses
a request whose Host header names a host the server does not answer to (DNS rebinding: a web page
whose own name was made to resolve to this server, so that it is "same-origin" with it); the
Origin check stops any other web page a user visits from driving the server (cross-site WebSocket
hijacking); `RequireToken` asks the token on every HTTP route but the few public on purpose
(`PUBLIC_PATHS`); and `hide_tokens_in_logs` keeps `?token=` (however its name is percent-encoded)
out of uvicorn's access and connection logs.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import json
import re
from urllib.parse import unquote_plus, urlsplit

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from voicebot import protocol
from voicebot.config import ConfigError
from voicebot.config.server import ServerConfig
from voicebot.metrics import Metrics
from voicebot.protocol import CloseCode, ErrorCode

log = logging.getLogger("voicebot.auth")

SUBPROTOCOL = "voicebot"
TOKEN_PREFIX = "token."


def presented_token(ws: HTTPConnection) -> str | None:
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
    if token is None or token_matches(presented_token(ws), token):
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


def token_matches(presented: str | None, *tokens: str | None) -> bool:
    """The presented token is one of `tokens` (constant-time; a None token matches nothing)."""
    return presented is not None and any(
        t is not None and hmac.compare_digest(presented.encode(errors="surrogateescape"), t.encode()) for t in tokens)


# --- the Host header: DNS rebinding


def host_allowed(host_header: str | None, allowed_hosts: list[str]) -> bool:
    """Whether a request naming this Host may be served.

    An IP address and localhost (and *.localhost, which browsers resolve to loopback themselves)
    cannot be rebound: a page that reached us by one of them was served by us. Any other name must
    be in `allowed_hosts` (`name`, `*.domain` for its subdomains, or `*` for any). No Host header:
    not a browser (HTTP/1.0), allowed.
    """
    if host_header is None:
        return True
    name = _host_name(host_header)
    if name is None:
        return False
    if name == "localhost" or name.endswith(".localhost"):
        return True
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(name)
        return True
    for allowed in (a.lower().rstrip(".") for a in allowed_hosts):
        if allowed == "*" or name == allowed or (allowed.startswith("*.") and name.endswith(allowed[1:])):
            return True
    return False


def _host_name(host_header: str) -> str | None:
    """The host name of a Host header (`name`, `name:port`, `[v6]:port`), lower case; None if malformed."""
    try:
        name = urlsplit(f"//{host_header}").hostname
    except ValueError:
        return None
    return name.rstrip(".") if name else None


class CheckHost:
    """ASGI middleware: a request (HTTP or WebSocket) whose Host is not allowed (`host_allowed`,
    with server.allowed_hosts and server.host itself) is refused before any route runs. The probes
    (/healthz, /readyz) are exempt: load balancers send whatever Host they were configured with."""

    def __init__(self, app: ASGIApp, server: ServerConfig) -> None:
        self.app = app
        self.allowed = [*server.allowed_hosts, server.host]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        host = HTTPConnection(scope).headers.get("host")
        if host_allowed(host, self.allowed):
            return await self.app(scope, receive, send)
        log.warning("refused a request for host %r (not in server.allowed_hosts)", host[:100])
        if scope["type"] == "websocket":  # closed before the handshake: the client gets HTTP 403
            await send({"type": "websocket.close", "code": CloseCode.POLICY})
        else:
            await _send_error(send, 403, "host_not_allowed", f"this server does not answer to host {host[:100]!r}: "
                                                             "add it to server.allowed_hosts")


# --- the token on HTTP routes

PROBES = frozenset({"/healthz", "/readyz"})
# Served without the token on purpose (docs/security.md): the probes (/readyz says only ready or
# not without it), the pages and their files (they hold no secret and ask for the token
# themselves), and the voice list the mic page reads.
PUBLIC_PATHS = PROBES | {"/", "/v1/voices"}
PUBLIC_PREFIXES = ("/static/",)
# Routes that check the token themselves: /v1/audio/* answers in OpenAI's error shape and counts it.
CHECKED_BY_THE_ROUTE = ("/v1/audio/",)


class RequireToken:
    """ASGI middleware: with server.token set, every HTTP route outside PUBLIC_PATHS,
    PUBLIC_PREFIXES and CHECKED_BY_THE_ROUTE needs it (?token=, or `Authorization: Bearer`);
    /metrics also takes server.metrics_token, for a Prometheus that should not hold the main one."""

    def __init__(self, app: ASGIApp, server: ServerConfig) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or self.server.token is None or path in PUBLIC_PATHS
                or path.startswith(PUBLIC_PREFIXES + CHECKED_BY_THE_ROUTE) or self.authorized(HTTPConnection(scope))):
            return await self.app(scope, receive, send)
        await _send_error(send, 401, "invalid_api_key", "missing or wrong token (?token= or Authorization: Bearer)",
                          {"www-authenticate": "Bearer"})

    def authorized(self, request: HTTPConnection) -> bool:
        extra = self.server.metrics_token if request.url.path == "/metrics" else None
        return token_matches(presented_token(request), self.server.token, extra)


async def _send_error(send: Send, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
    """An error in the /v1/audio routes' shape (OpenAI's), from a middleware."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def install(app, server: ServerConfig) -> None:
    """The token and Host checks, in front of every route (the Host first)."""
    app.add_middleware(RequireToken, server=server)
    app.add_middleware(CheckHost, server=server)


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


# A query parameter in a logged URL: its name (percent-encoded or not) and its value.
_QUERY_PARAMETER = re.compile(r"([?&;])([^=&;\s\"'?]+)=([^&;\s\"']*)")


def _hidden(match: re.Match) -> str:
    separator, name, _ = match.groups()
    # The server reads `tok%65n` as `token` (percent-decoding, as every URL parser does): so does this.
    return f"{separator}{name}=<hidden>" if unquote_plus(name).strip().lower() == "token" else match.group(0)


class _HideTokens(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "=" in message:
            hidden = _QUERY_PARAMETER.sub(_hidden, message)
            if hidden != message:
                record.msg, record.args = hidden, ()
        return True


def hide_tokens_in_logs() -> None:
    """uvicorn logs every request and WebSocket with its query string: `?token=` would be in it."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HideTokens) for f in logger.filters):
            logger.addFilter(_HideTokens())
