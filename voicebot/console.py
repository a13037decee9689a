"""The operator console's server side: a live feed of every session and channel, and its controls.

    static/console.html ──WebSocket /v1/console──► a snapshot, then every session's events as they happen
                        ──POST /v1/console/...───► session.handle(typed command) | ChannelHub.set_muted

What it shows comes from the session's typed door out and the runtime, nothing added inside a
Session: every session's typed events (voicebot/session/events.py) as its sender hands them to its
front end, offered to the runtime's observers (`Runtime.observe`, called by frontends/run.py), the
runtime's session registry (who is connected), and the hub's channels (speaker, listeners, muted).
The console is a front end of its own: it keeps the events in FEED_EVENTS and serializes them for
its wire itself, once, as {"type": "event", "session": id, "event": <the event as /v1/voice's JSON
object, voice.payload>}, without the session's identity (session.ready's resume_token and session_id,
voice.PRIVATE_FIELDS: the operator sees the session id beside it, the conversation's key never).
Reply audio frames are not kept: audio.start and audio.end say when the bot speaks.

Its controls are commands through the session's typed door, `Session.handle`, built and validated by
the protocol's own models: say a line (`protocol.Say`), drop the reply now playing
(`protocol.Interrupt`), switch the voice or the persona (`protocol.SessionUpdate`, voice or
responder). Two have no protocol message: ending a session is `request_close` (what the runtime's
drain on SIGTERM uses), and muting the bot is the channel's (`ChannelHub.set_muted`: its reply audio
stops reaching the channel's listeners, on every server of a cluster, and it stays muted across its
speaker's reconnects; in a cluster that has lost its Redis the mute holds on this server only, and
the command answers 503 cluster_unavailable).

Who may: the feed is accepted like every WebSocket (auth.accept: the token, the Origin); the commands
are HTTP routes, so the token middleware (auth.RequireToken) answers 401 without the token, and each
also refuses a page of another origin (403), which on a server with no token is what stops any web
page the operator visits from posting commands to it.

Bounds: at most CONSOLES_MAX feeds at once; each has its own queue of FEED_QUEUE_MAX messages and a
console that falls that far behind is dropped (close 4009), counted in voicebot_console_dropped_total;
the session it watches never waits on it. For a console opened mid-show, each live session's last
HISTORY_MAX events are kept (partial transcripts and reply deltas are sent live only); a command's
body is at most COMMAND_BYTES_MAX.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, ValidationError

from voicebot import auth, protocol
from voicebot.channels import ChannelRefused
from voicebot.frontends.voice import PRIVATE_FIELDS, payload
from voicebot.protocol import CloseCode, ErrorCode, ProtocolError
from voicebot.runtime import Runtime
from voicebot.session.events import (AsrFinal, AsrPartial, AudioEnd, AudioInterrupted, AudioStart, Error, ReplyDelta,
                                     ReplyDone, SessionReady, SessionUpdated, SpeechStarted, TurnEnd)
from voicebot.transport import Wire, receive_loop

log = logging.getLogger("voicebot.console")

CONSOLES_MAX = 8
# A turn is about 10 events and a partial transcript a few a second: 512 messages is a minute of a
# busy show that the console did not read, at most 512 x ~1 KB.
FEED_QUEUE_MAX = 512
HISTORY_MAX = 100  # events per live session (about 10 turns)
REGISTRY_POLL_S = 0.5  # how often a feed looks for sessions that came or went, and at the channels
COMMAND_BYTES_MAX = 8 * 1024  # a `say` of 2000 characters is at most ~6 KB of JSON
CLOSE_TIMEOUT_S = 1.0

# The session events a console shows; the LIVE_ONLY ones are not kept for a console opened later.
FEED_EVENTS = (SessionReady, SessionUpdated, SpeechStarted, AsrPartial, AsrFinal, TurnEnd, ReplyDelta, ReplyDone,
               AudioStart, AudioEnd, AudioInterrupted, Error)
LIVE_ONLY = (AsrPartial, ReplyDelta)


@dataclass(eq=False)
class Feed:
    """One console's connection: its own bounded queue."""

    queue: asyncio.Queue[str] = field(default_factory=lambda: asyncio.Queue(FEED_QUEUE_MAX))
    dropped: asyncio.Event = field(default_factory=asyncio.Event)


class Console:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._feeds: set[Feed] = set()
        self._history: dict[str, deque[dict]] = {}  # session id -> its last events, as sent to consoles
        self.dropped = Counter("voicebot_console_dropped_total", "Operator consoles dropped for falling behind their feed",
                               registry=rt.metrics.registry)
        rt.observers.append(self._on_session_message)

    # ---- the feed ---------------------------------------------------------------------------------

    def _on_session_message(self, session_id: str, item: object) -> None:
        """Every outbound message of every session, typed (Runtime.observe); never waits."""
        if not isinstance(item, FEED_EVENTS):
            return  # reply audio frames, and the events an operator does not follow
        event = {k: v for k, v in payload(item).items() if k not in PRIVATE_FIELDS}
        message = {"type": "event", "session": session_id, "event": event}
        if not isinstance(item, LIVE_ONLY):
            if session_id not in self._history:
                self._forget_gone_sessions()
                self._history[session_id] = deque(maxlen=HISTORY_MAX)
            self._history[session_id].append(message)
        if self._feeds:
            text = json.dumps(message)
            for feed in list(self._feeds):
                self._offer(feed, text)

    def _forget_gone_sessions(self) -> None:
        for session_id in [s for s in self._history if s not in self.rt.sessions]:
            del self._history[session_id]

    def _offer(self, feed: Feed, message: str) -> None:
        try:
            feed.queue.put_nowait(message)
        except asyncio.QueueFull:
            if not feed.dropped.is_set():
                log.warning("an operator console fell %d messages behind: dropped", FEED_QUEUE_MAX)
                self.dropped.inc()
                feed.dropped.set()
            self._feeds.discard(feed)

    def _sessions(self) -> dict:
        """Who is connected, and the channels."""
        return {"live": sorted(self.rt.sessions), "channels": self.rt.channels.describe()}

    async def serve(self, ws: WebSocket) -> None:
        """One console: the snapshot, then the sessions' events and their comings and goings."""
        settings = self.rt.settings.server
        if not await auth.accept(ws, settings.token, self.rt.metrics, settings.allowed_origins):
            return
        if len(self._feeds) >= CONSOLES_MAX:
            with contextlib.suppress(Exception):
                await ws.send_json(protocol.error(ErrorCode.BUSY, f"the server is at its limit of {CONSOLES_MAX} consoles"))
                await ws.close(CloseCode.TRY_AGAIN_LATER, "busy")
            return
        feed = Feed()
        self._forget_gone_sessions()
        self._offer(feed, json.dumps({
            "type": "snapshot", **self._sessions(),
            "voices": [v.name for v in self.rt.synthesizer.voices()], "responders": sorted(self.rt.responders),
            "history": [message for messages in self._history.values() for message in messages]}))
        self._feeds.add(feed)
        tasks = [asyncio.create_task(coro) for coro in (self._send(ws, feed), self._watch_registry(feed),
                                                          receive_loop(ws, self._ignore), feed.dropped.wait())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._feeds.discard(feed)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if feed.dropped.is_set():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(CloseCode.TOO_SLOW, "console fell behind"), CLOSE_TIMEOUT_S)

    @staticmethod
    async def _send(ws: WebSocket, feed: Feed) -> None:
        while True:
            await ws.send_text(await feed.queue.get())

    async def _watch_registry(self, feed: Feed) -> None:
        sent = self._sessions()
        while True:
            await asyncio.sleep(REGISTRY_POLL_S)
            now = self._sessions()
            if now != sent:
                self._offer(feed, json.dumps({"type": "sessions", **now}))
                sent = now

    @staticmethod
    async def _ignore(message: Wire) -> None:
        """A console only receives; its commands are HTTP requests (they need the token on each)."""

    # ---- the controls -------------------------------------------------------------------------------

    async def command(self, session_id: str, message: BaseModel) -> JSONResponse:
        """Hand a typed command to the session's door (ending it: its close request)."""
        session = self.rt.sessions.get(session_id)
        if session is None:
            return _refused(404, "unknown_session", f"no live session {session_id[:64]!r}")
        if isinstance(message, EndSession):
            session.request_close(CloseCode.NORMAL, ErrorCode.ENDED_BY_OPERATOR, "ended by the operator")
        else:
            await session.handle(message)
        log.info("operator console: %s to session %s", message.type, session_id[:8])
        return JSONResponse({"session": session_id, "applied": message.type}, status_code=202)


def router(console: Console) -> APIRouter:
    routes = APIRouter()
    allowed_origins = console.rt.settings.server.allowed_origins

    async def body(request: Request, model: type[BaseModel], kind: str) -> BaseModel | JSONResponse:
        """The request's JSON as a `model` of type `kind` (the protocol's own models validate theirs), or the refusal."""
        if not auth.origin_allowed(request.headers.get("origin"), request.headers.get("host"), allowed_origins):
            return _refused(403, ErrorCode.FORBIDDEN_ORIGIN, f"web pages from {request.headers['origin'][:100]!r} may not command")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > COMMAND_BYTES_MAX:
                return _refused(413, ErrorCode.FRAME_TOO_LARGE, f"a command is at most {COMMAND_BYTES_MAX} bytes")
        try:
            data = protocol.load_json(raw.decode()) if raw else {}
            if not isinstance(data, dict):
                raise ProtocolError(ErrorCode.INVALID_MESSAGE, "a command's body is a JSON object")
            return model.model_validate({**data, "type": kind})
        except UnicodeDecodeError:
            return _refused(400, ErrorCode.INVALID_JSON, "a command's body is UTF-8 JSON")
        except ProtocolError as exc:
            return _refused(400, exc.code, exc.message)
        except ValidationError as exc:
            return _refused(400, ErrorCode.INVALID_MESSAGE, f"{kind}: {exc.errors()[0]['msg']}")

    @routes.websocket("/v1/console")
    async def feed(ws: WebSocket) -> None:
        await console.serve(ws)

    @routes.post("/v1/console/sessions/{session_id}/{kind}")
    async def session_command(request: Request, session_id: str, kind: str) -> JSONResponse:
        """say {text, interrupt}, interrupt, session.update {voice, responder}, end."""
        if kind not in SESSION_COMMANDS:
            return _refused(404, "unknown_command", f"no command {kind[:64]!r}; the console's: {', '.join(SESSION_COMMANDS)}")
        message = await body(request, SESSION_COMMANDS[kind], kind)
        if isinstance(message, JSONResponse):
            return message
        return await console.command(session_id, message)

    @routes.post("/v1/console/channels/{name}/mute")
    async def mute(request: Request, name: str) -> JSONResponse:
        """{muted: true|false}: the bot's reply audio on this channel's listeners."""
        if not protocol.CHANNEL_NAME.fullmatch(name):
            return _refused(400, ErrorCode.INVALID_MESSAGE, "a channel is 1-64 letters, digits, _ . or -")
        message = await body(request, MuteChannel, "mute")
        if isinstance(message, JSONResponse):
            return message
        try:
            await console.rt.channels.set_muted(name, message.muted)
        except ChannelRefused as exc:  # a cluster without its Redis: muted on this server only
            return _refused(503, exc.code, exc.message)
        log.info("operator console: channel %r %s", name, "muted" if message.muted else "unmuted")
        return JSONResponse({"channel": name, "muted": message.muted}, status_code=202)

    return routes


class _Command(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as the protocol's messages


class EndSession(_Command):
    """End a session (the console's; no client sends it): it is closed with ended_by_operator, 1000."""

    type: Literal["end"]


class MuteChannel(_Command):
    type: Literal["mute"]
    muted: bool


# The console's session commands by route name: the protocol's own messages, and ending it.
SESSION_COMMANDS: dict[str, type[BaseModel]] = {
    "say": protocol.Say, "interrupt": protocol.Interrupt, "session.update": protocol.SessionUpdate, "end": EndSession,
}


def _refused(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(protocol.error(code, message), status_code=status)


def install(app, rt: Runtime) -> Console:
    """The console's feed and command routes on `app` (before any catch-all WebSocket route)."""
    console = Console(rt)
    app.include_router(router(console))
    return console
