"""What every /v1/audio/* request goes through: admission, its place, and OpenAI's error shape.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and status; a request
gives its place back however it ends (an error, a body that cannot be parsed, a client that hangs
up mid-body, a bug: a 500 in the same shape). With
`server.token` set the token is required, as the API key (`Authorization: Bearer`). A request
takes a place in `server.max_sessions` while it runs (a speech stream until its last byte): at the
limit it gets 503 `busy` with Retry-After. It is also a session of its client address
(`server.max_sessions_per_client`, voicebot/limits.py), so one address cannot hold every place
with requests: past that limit it gets 429 `rate_limit_exceeded` with Retry-After.
voicebot_audio_api_requests_total{route, outcome} counts requests (outcome `ok` or the error code),
voicebot_audio_api_audio_seconds_total{route} the audio synthesized or uploaded.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from voicebot import auth
from voicebot.limits import ClientLimits

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request refused or failed: answered with its status in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return JSONResponse(body, status_code=self.status, headers=headers)

    @property
    def outcome(self) -> str:
        """The label of this failure in voicebot_audio_api_requests_total."""
        return self.code or str(self.status)


class AudioRequests:
    """The /v1/audio/* requests running now; the app counts them toward server.max_sessions."""

    def __init__(self) -> None:
        self.running = 0


class Place:
    """One request's place in server.max_sessions and among its address's sessions, from
    admission to its last byte."""

    def __init__(self, requests: AudioRequests, client_limits: ClientLimits, request: Request, metrics, route: str) -> None:
        self._requests, self._client_limits, self._metrics, self.route = requests, client_limits, metrics, route
        self._held = True
        requests.running += 1
        self._address = client_limits.take_session(request.scope)
        metrics.audio_api_active.inc()

    def release(self, outcome: str) -> None:
        """Give the place back (once) and count the request's outcome: `ok` or an error code."""
        if self._held:
            self._held = False
            self._requests.running -= 1
            self._client_limits.release_session(self._address)
            self._metrics.audio_api_active.dec()
            self._metrics.audio_api_requests.labels(self.route, outcome).inc()


def admit(request: Request, route: str):
    """The runtime and the request's place, or an ApiError (counted) if it cannot be served now."""
    rt, client_limits = request.app.state.runtime, request.app.state.client_limits
    token = rt.settings.server.token
    try:
        if token is not None and not auth.token_matches(auth.presented_token(request), token):
            raise ApiError(401, "missing or wrong API key (the server's token)", code="invalid_api_key")
        if rt.draining or not rt.ready:
            raise ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error")
        # This address's own share first, as for WebSockets: it is the reason a retry would meet again.
        if too_many := client_limits.refusal(request.scope, session=True):
            raise ApiError(429, too_many, code="rate_limit_exceeded", kind="rate_limit_error", retry_after_s=5)
        if request.app.state.occupied() >= rt.settings.server.max_sessions:
            raise ApiError(503, f"the server is at its limit of {rt.settings.server.max_sessions} sessions",
                           code="busy", kind="server_error", retry_after_s=5)
    except ApiError as exc:
        rt.metrics.audio_api_requests.labels(route, exc.outcome).inc()
        raise
    return rt, Place(request.app.state.audio_requests, client_limits, request, rt.metrics, route)


@contextlib.contextmanager
def refusing(place: Place):
    """Around a request's work before its response: whatever ends it early gives its place back.
    An ApiError is answered as itself; a client that hung up gets nothing (there is nobody to
    read it); anything else is a bug, logged, answered 500 in OpenAI's shape."""
    try:
        yield
    except ApiError as exc:
        place.release(exc.outcome)
        raise
    except ClientDisconnect:
        place.release("client_gone")
        raise
    except Exception as exc:
        place.release("internal_error")
        log.exception("%s failed", place.route)
        raise ApiError(500, f"the server failed: {type(exc).__name__}", kind="server_error", code="internal_error") from exc
    except BaseException:  # cancelled: the server is stopping
        place.release("client_gone")
        raise


def answer(exc: ApiError | ClientDisconnect) -> Response:
    return exc.response() if isinstance(exc, ApiError) else Response(status_code=400)
