"""Channels: named rooms where one session speaks and any number of listeners follow it read-only.

A speaking session joins a channel with `session.start {channel}`; an OBS overlay connects to
`/v1/voice?role=listener&channel=NAME` and receives every event and audio frame that session is
sent. The name outlives connections, so an overlay set up before the show keeps working while
the speaking client reconnects. While a channel's speaker is connected, it owns the channel: another
session takes it over only by resuming the speaker's conversation (the same client, reconnected
before its old socket was seen closed; only it knows the resume token), so no stranger can make an
overlay on stream speak. Once the speaker has gone, the next session to claim the channel speaks.
With `cluster.redis_url` the same holds across servers (voicebot/cluster/channels.py: `claim` asks Redis).
A speaker that loses its channel (another session took it over with its resume token, or, in a
cluster, claimed it once its owner key had expired) is told so with `error {code: "channel_lost"}`
through the `tell` it claimed with, counted in voicebot_channel_speakers_lost_total{reason}, and from
that moment nothing it is sent reaches the channel's listeners; the session itself goes on.

Listeners must never slow the session they follow: `mirror` only offers each message to a
listener's own bounded queue and never waits. A listener is dropped with close code 4009, and
counted in voicebot_listeners_dropped_total{reason}, when its queue is full (`fell_behind`) or when
its socket has not taken a message for LISTENER_SEND_TIMEOUT_S (`stalled`: a client that stopped
reading, whose kernel buffers hold megabytes before the queue would fill); the session does not notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from prometheus_client import Counter
from starlette.websockets import WebSocket

from voicebot import PROTOCOL_VERSION, protocol
from voicebot.metrics import Metrics
from voicebot.protocol import CloseCode, ErrorCode
from voicebot.transport import Wire, receive_loop

log = logging.getLogger("voicebot.channels")

# Messages a listener may lag behind before it is dropped. The session sends reply audio at most
# pacing.lead_ms (default 400 ms) ahead of real time, so a listener that keeps up holds a few
# frames; 64 messages is about 10 s of 200 ms frames, at most 64 x 9600 B = 600 KB per listener.
LISTENER_QUEUE_MAX = 64
# A send to a listener that has not completed in this long is a client that stopped reading: its
# socket's buffers are full (the send waits only then), and it has taken nothing for that long. The
# same ~10 s of reply audio as the queue's bound; a listener that keeps up takes a frame in milliseconds.
LISTENER_SEND_TIMEOUT_S = 10.0
# Why a listener was dropped: the label of voicebot_listeners_dropped_total.
DROPPED_BECAUSE = {
    "fell_behind": f"fell {LISTENER_QUEUE_MAX} messages behind",
    "stalled": "took no message for {timeout_s:g} s",
}
# A dropped listener gets this long to take its close frame before the connection is abandoned.
CLOSE_TIMEOUT_S = 1.0

# How a speaker hears that it lost its channel: a session's outbox.error(code, message, **fields).
Tell = Callable[..., Awaitable[None]]
# Why a speaker lost its channel: what it is told, by reason (the label of the counter).
LOST_BECAUSE = {
    "resumed": "another session resumed this conversation with its resume token and speaks on the channel now",
    "claimed_elsewhere": "a session on another server owns the channel now (it resumed this conversation with "
                         "its resume token, or claimed the channel after this server could not renew its ownership "
                         "in time)",
}


class Listener:
    """One read-only connection following a channel, with its own bounded queue."""

    def __init__(self, send_text: Callable[[str], Awaitable], send_bytes: Callable[[bytes], Awaitable]) -> None:
        self._send_text = send_text
        self._send_bytes = send_bytes
        self.queue: asyncio.Queue[Wire] = asyncio.Queue(LISTENER_QUEUE_MAX)
        self.dropped = asyncio.Event()
        # Called when a send has not completed within LISTENER_SEND_TIMEOUT_S: the hub counts the
        # listener dropped and removes it (add_listener); a listener on no hub is only marked dropped.
        self.on_stalled: Callable[[], None] = self.dropped.set

    def offer(self, item: Wire) -> bool:
        """Queue without waiting; False when the listener has fallen behind."""
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            return False
        return True

    async def run_sender(self) -> None:
        """Send the queue to the socket until a send takes longer than LISTENER_SEND_TIMEOUT_S.
        The bound is a timer that cancels this task (asyncio.wait_for would run each send as a task
        of its own: a loop turn more per message, and a listener that keeps up fell behind)."""
        loop, sender = asyncio.get_running_loop(), asyncio.current_task()
        stalled = False

        def give_up() -> None:
            nonlocal stalled
            stalled = True
            sender.cancel()

        while True:
            item = await self.queue.get()
            timer = loop.call_later(LISTENER_SEND_TIMEOUT_S, give_up)
            try:
                await (self._send_bytes(item) if isinstance(item, bytes) else self._send_text(item))
            except asyncio.CancelledError:
                if not stalled:
                    raise
                self.on_stalled()
                return
            finally:
                timer.cancel()


class ChannelRefused(Exception):
    """A session may not speak on the channel it named; `code` is the error event's."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Channel:
    speaker: str | None = None  # session id
    owner: str | None = None  # the speaker's resume token (None: anyone may take the channel)
    tell: Tell | None = None  # how to tell the speaker it lost the channel
    listeners: set[Listener] = field(default_factory=set)


class ChannelHub:
    """Which session speaks on which channel, and who listens. Lives on the event loop, lock-free."""

    def __init__(self, metrics: Metrics, max_listeners: int) -> None:
        self.metrics = metrics
        self.max_listeners = max_listeners
        self._channels: dict[str, Channel] = {}
        self._speaking: dict[str, str] = {}  # session id -> channel name
        # channel_lost events on their way to their sessions' outboxes: one per speaker that lost a channel.
        self._notices: set[asyncio.Task] = set()
        self.speakers_lost = Counter("voicebot_channel_speakers_lost_total",
                                     "Speakers that lost their channel to another session while connected, by reason "
                                     "(resumed: by its resume token, on this server; claimed_elsewhere: by a session "
                                     "on another server, with the resume token or once the owner key had expired)",
                                     ["reason"], registry=metrics.registry)
        for reason in LOST_BECAUSE:
            self.speakers_lost.labels(reason)
        # The channels the operator console muted (voicebot/console.py): one name per mute, unmuting
        # removes it. In a cluster the whole cluster's, kept in step through Redis (cluster/channels.py).
        self._muted: set[str] = set()
        self.muted_frames = Counter("voicebot_channel_muted_frames_total",
                                    "Reply audio frames not sent to the listeners of a channel the operator muted",
                                    registry=metrics.registry)

    # ---- speaking sessions ---------------------------------------------------------------------

    async def claim(self, name: str, session_id: str, owner: str, resumed_from: str | None = None,
                    tell: Tell | None = None) -> None:
        """What a session asks: make it the channel's speaker (see `speak`), or raise ChannelRefused."""
        if not self.speak(name, session_id, owner, resumed_from, tell):
            raise ChannelRefused(ErrorCode.CHANNEL_TAKEN, taken_message(name))

    def speak(self, name: str, session_id: str, owner: str | None = None, resumed_from: str | None = None,
              tell: Tell | None = None) -> bool:
        """Make this session the channel's speaker, replacing one whose conversation it resumed
        (`resumed_from`, the resume token it came back with), which is told; False when another
        owns the channel. `tell` is how this session will hear that it lost the channel in turn."""
        if self.held_against(name, resumed_from):
            return False
        channel = self._channels.setdefault(name, Channel())
        if channel.speaker is not None:
            self._unseat(name, "resumed")
        channel.speaker, channel.owner, channel.tell = session_id, owner, tell
        self._speaking[session_id] = name
        self._notify(name, protocol.event("channel.speaker", channel=name, speaking=True))
        return True

    def held_against(self, name: str, resumed_from: str | None) -> bool:
        """Whether a speaker here owns the channel and `resumed_from` is not its resume token."""
        channel = self._channels.get(name)
        return channel is not None and channel.speaker is not None and channel.owner not in (None, resumed_from)

    def leave(self, session_id: str) -> None:
        name = self._vacate(session_id)
        if name is not None:
            self._tell_free(name)

    def _vacate(self, session_id: str) -> str | None:
        """Empty the seat of a speaker that left; the channel's name, None if it spoke on none."""
        name = self._speaking.pop(session_id, None)
        if name is not None:
            channel = self._channels[name]
            channel.speaker = channel.owner = channel.tell = None
        return name

    def _tell_free(self, name: str) -> bool:
        """Tell the channel's listeners it has no speaker, and forget it if no one listens; False (and
        nothing told) when a speaker took the seat meanwhile."""
        channel = self._channels.get(name)
        if channel is not None and channel.speaker is not None:
            return False
        if channel is not None:
            self._notify(name, protocol.event("channel.speaker", channel=name, speaking=False))
            self._forget_if_empty(name)
        return True

    def _unseat(self, name: str, reason: str) -> None:
        """The channel's speaker, still connected, has lost it to another session (`reason`, a key of
        LOST_BECAUSE): from now on nothing it is sent reaches the listeners, and it is told so."""
        channel = self._channels[name]
        session_id, tell = channel.speaker, channel.tell
        self._speaking.pop(session_id, None)
        channel.speaker = channel.owner = channel.tell = None
        self.speakers_lost.labels(reason).inc()
        log.warning("channel %r: speaker %s lost it (%s)", name, session_id and session_id[:8], reason)
        if tell is not None:
            notice = asyncio.ensure_future(tell(ErrorCode.CHANNEL_LOST, lost_message(name, reason), channel=name, reason=reason))
            self._notices.add(notice)
            notice.add_done_callback(self._notices.discard)

    def speaks_on_channel(self, session_id: str) -> bool:
        return session_id in self._speaking

    def mirror(self, session_id: str, item: Wire) -> None:
        """Offer one outbound message of a session to its channel's listeners (never waits)."""
        name = self._speaking.get(session_id)
        if name is not None and not self._silenced(name, item):
            self._send(name, item)

    def _send(self, name: str, item: Wire) -> None:
        """One message of the channel's speaker to its listeners here (a cluster's hub: and to the
        other servers')."""
        channel = self._channels[name]
        for listener in list(channel.listeners):
            if not listener.offer(item):
                self._drop(name, listener)

    # ---- the operator console (voicebot/console.py) -------------------------------------------------

    async def set_muted(self, name: str, muted: bool) -> None:
        """Mute the bot on a channel: its speaker's reply audio stops reaching the listeners (its events
        still do). The channel's, not the session's: it holds across the speaker's reconnects. (A
        cluster's hub mutes it on every server, or raises ChannelRefused when it cannot.)"""
        self._mark_muted(name, muted)

    def _mark_muted(self, name: str, muted: bool) -> None:
        (self._muted.add if muted else self._muted.discard)(name)

    def _silenced(self, name: str, item: Wire) -> bool:
        """Whether `item` is reply audio of a muted channel, which no listener gets (counted)."""
        if isinstance(item, bytes) and name in self._muted:
            self.muted_frames.inc()
            return True
        return False

    def describe(self) -> dict[str, dict]:
        """Each channel known here: its speaker's session id (or None), its listeners, whether muted."""
        described = {}
        for name in sorted(self._channels.keys() | self._muted):
            channel = self._channels.get(name, Channel())
            described[name] = {"speaker": channel.speaker, "listeners": len(channel.listeners), "muted": name in self._muted}
        return described

    # ---- listeners --------------------------------------------------------------------------------

    @property
    def listener_count(self) -> int:
        return sum(len(c.listeners) for c in self._channels.values())

    def add_listener(self, name: str, listener: Listener) -> bool:
        """Join a channel; False when the server is at its listener limit."""
        if self.listener_count >= self.max_listeners:
            return False
        channel = self._channels.setdefault(name, Channel())
        channel.listeners.add(listener)
        listener.on_stalled = lambda: self._drop(name, listener, "stalled")
        self.metrics.active_listeners.inc()
        listener.offer(
            json.dumps(protocol.event("listener.ready", channel=name, speaking=self.is_speaking(name), protocol_version=PROTOCOL_VERSION))
        )
        return True

    def is_speaking(self, name: str) -> bool:
        channel = self._channels.get(name)
        return channel is not None and channel.speaker is not None

    def remove_listener(self, name: str, listener: Listener) -> None:
        channel = self._channels.get(name)
        if channel is None or listener not in channel.listeners:
            return
        channel.listeners.discard(listener)
        self.metrics.active_listeners.dec()
        self._forget_if_empty(name)

    def _drop(self, name: str, listener: Listener, reason: str = "fell_behind") -> None:
        if listener.dropped.is_set():
            return  # already dropped (and counted) for another message it had no room for
        log.warning("listener on channel %r %s: dropped", name, DROPPED_BECAUSE[reason].format(timeout_s=LISTENER_SEND_TIMEOUT_S))
        self.metrics.listeners_dropped.labels(reason).inc()
        self.remove_listener(name, listener)
        listener.dropped.set()

    def _notify(self, name: str, event: dict) -> None:
        text = json.dumps(event)
        for listener in list(self._channels[name].listeners):
            if not listener.offer(text):
                self._drop(name, listener)

    def _forget_if_empty(self, name: str) -> None:
        channel = self._channels.get(name)
        if channel is not None and channel.speaker is None and not channel.listeners:
            del self._channels[name]


def taken_message(name: str) -> str:
    return (f"channel {name!r} has a speaker; this session goes on without it (only the speaker's own client, "
            "resuming, can take a channel over)")


def lost_message(name: str, reason: str) -> str:
    return (f"channel {name!r}: {LOST_BECAUSE[reason]}; this session goes on, but nothing it says reaches the channel's "
            "listeners any more. If the other session is your own client, close this one; if not, your resume token "
            "is known to someone else: start a new session without it")


async def run_listener(ws: WebSocket, hub: ChannelHub, name: str) -> None:
    """Serve one accepted listener connection (channel name already checked) until it closes or falls behind."""
    listener = Listener(ws.send_text, ws.send_bytes)
    if not hub.add_listener(name, listener):
        with contextlib.suppress(Exception):
            await ws.send_json(protocol.error(ErrorCode.BUSY, f"the server is at its limit of {hub.max_listeners} listeners", retry_after_s=5))
            await ws.close(CloseCode.TRY_AGAIN_LATER, "busy")
        return
    sender = asyncio.create_task(listener.run_sender())
    receiver = asyncio.create_task(_read_only(ws, listener, lambda: hub._drop(name, listener)))
    dropped = asyncio.create_task(listener.dropped.wait())
    try:
        await asyncio.wait({sender, receiver, dropped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hub.remove_listener(name, listener)
        for task in (sender, receiver, dropped):
            task.cancel()
        await asyncio.gather(sender, receiver, dropped, return_exceptions=True)
    if listener.dropped.is_set():
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.close(CloseCode.TOO_SLOW, "listener fell behind"), CLOSE_TIMEOUT_S)


async def _read_only(ws: WebSocket, listener: Listener, fell_behind: Callable[[], None]) -> None:
    """Answer pings; anything else a listener sends is an error (it cannot speak). A listener whose
    queue has no room for the answer has fallen behind: dropped and counted, as for the channel's own."""

    async def on_message(message: Wire) -> None:
        try:
            parsed = protocol.parse_text(message) if isinstance(message, str) else None
        except protocol.ProtocolError as exc:
            reply = protocol.error(exc.code, exc.message)
        else:
            if isinstance(parsed, protocol.Ping):
                reply = protocol.event("pong", id=parsed.id)
            else:
                reply = protocol.error(ErrorCode.READ_ONLY, "a listener only receives; speak through a session")
        if not listener.offer(json.dumps(reply)):
            fell_behind()

    await receive_loop(ws, on_message)
