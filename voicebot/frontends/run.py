"""One speaking session served on one WebSocket, whatever the front end that translates its wire.

    socket ─► transport.receive_loop ─► FrontEnd.on_message ─► Session.arrived, Session.handle(command)
    socket ◄── FrontEnd.deliver ◄── Session.run_sender ◄── outbox (events, frames)
                                  ├─► the channel's listeners (voice.listener_wire), if it speaks on one
                                  └─► the runtime's observers (Runtime.observe: the operator console), typed
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from starlette.websockets import WebSocketDisconnect

from voicebot.frontends import voice
from voicebot.runtime import Runtime
from voicebot.session import Session
from voicebot.session.events import Outbound
from voicebot.session.machine import Deliver
from voicebot.transport import Socket, Wire, receive_loop


class FrontEnd(Protocol):
    """A translator between one wire format and a session (voice.VoiceFrontEnd, realtime.RealtimeFrontEnd,
    obs_plugin.ObsFrontEnd)."""

    async def start(self, session: Session) -> None:
        """The commands that open the session, if the client does not send its own session.start."""

    async def on_message(self, session: Session, message: Wire) -> None:
        """One message off the socket: `session.arrived`, then its commands to `session.handle`."""

    async def deliver(self, message: Outbound) -> None:
        """One event or frame of the session, on this wire."""

    def ended(self) -> None:
        """The client has gone or the session closed: report what the front end counted."""


def open_session(rt: Runtime, deliver: Deliver) -> Session:
    """A session whose events and frames go to `deliver` and, while it speaks on a channel, to the
    channel's listeners too (in /v1/voice's wire, the listeners' own), and, typed, to the runtime's
    observers (the operator console serializes what it keeps for its own wire)."""

    async def deliver_and_mirror(message: Outbound) -> None:
        if rt.channels.speaks_on_channel(session.id):  # its listeners' wire is built only for them
            rt.channels.mirror(session.id, voice.listener_wire(message))  # never waits: listeners can't slow the session
        rt.observe(session.id, message)  # never waits either
        await deliver(message)

    session = Session(rt, deliver_and_mirror)
    return session


async def run_session(ws: Socket, front_end: FrontEnd, rt: Runtime) -> None:
    """Serve one speaking session on `ws`, translated by `front_end`."""
    session = open_session(rt, front_end.deliver)
    rt.sessions[session.id] = session
    rt.metrics.active_sessions.inc()
    rt.metrics.sessions_total.inc()
    sender = asyncio.create_task(session.run_sender())
    close_requested = asyncio.create_task(session.watch.close_requested.wait())
    start_deadline = asyncio.create_task(session.expect_start(rt.settings.server.start_timeout_s))
    try:
        await front_end.start(session)

        async def on_message(message: Wire) -> None:
            await front_end.on_message(session, message)

        # Also ended by the sender (the socket failed while sending) and by a close request (flooding).
        await receive_loop(ws, on_message, until=(sender, close_requested))
        if session.watch.close_request is not None:
            code, error_code, reason = session.watch.close_request
            await session.outbox.error(error_code, reason)
            await session.close()
            await session.outbox.put(None)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sender, 2)
            # Its place is free before the client hears the close: a client that connects again at
            # once (or the next in line, at max_sessions) must not find it still taken.
            rt.session_left(session.id)
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the client may be gone already
                await ws.close(code, reason)
    finally:
        front_end.ended()
        await session.close()
        for task in (sender, close_requested, start_deadline):
            task.cancel()
        await asyncio.gather(sender, close_requested, start_deadline, return_exceptions=True)
        rt.session_left(session.id)
        rt.metrics.active_sessions.dec()
