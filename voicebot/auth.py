"""The optional shared token, checked on every WebSocket before anything else happens on it.

A client presents it in one of three ways, so that every kind of client has one it can use:
- `?token=` in the URL: the only one the OBS plugin (a URL field) can use; it shows in access logs.
- the subprotocol `token.<TOKEN>` next to `voicebot`: what the pages use, since a browser can set
  no headers on a WebSocket; the server answers with `voicebot`.
- `Authorization: Bearer <TOKEN>`: for programs (the reference client).
"""

from __future__ import annotations

import contextlib
import hmac

from starlette.websockets import WebSocket

from voicebot import protocol
from voicebot.metrics import Metrics
from voicebot.protocol import CloseCode, ErrorCode

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


async def accept(ws: WebSocket, token: str | None, metrics: Metrics) -> bool:
    """Accept the connection; if the token is wrong, say so and close it (False)."""
    # A browser that offered subprotocols fails the connection unless the server picks one.
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in ws.scope.get("subprotocols", []) else None)
    presented = presented_token(ws)
    if token is None or (presented is not None and hmac.compare_digest(presented.encode(), token.encode())):
        return True
    metrics.sessions_refused.labels(ErrorCode.UNAUTHORIZED).inc()
    metrics.errors.labels(ErrorCode.UNAUTHORIZED).inc()
    with contextlib.suppress(Exception):
        await ws.send_json(protocol.error(ErrorCode.UNAUTHORIZED, "missing or wrong token"))
        await ws.close(CloseCode.UNAUTHORIZED, "unauthorized")
    return False
