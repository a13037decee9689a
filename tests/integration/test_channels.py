"""Channels: a session's listeners get what it is sent, and one that stops reading is dropped
without holding the session back: once its queue is full (counted in messages), or once its
socket has taken nothing for LISTENER_SEND_TIMEOUT_S (a client that never reads)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import time

import pytest
import websockets

from tests.conftest import make_settings, speech_pcm
from voicebot import channels
from voicebot.channels import LISTENER_QUEUE_MAX, ChannelRefused, Listener
from voicebot.frontends.run import open_session
from voicebot.frontends.voice import payload, wire
from voicebot.messages import AudioFrame
from voicebot.protocol import CloseCode
from voicebot.runtime import Runtime


class Sink:
    """A socket's two send functions that keep everything; each send yields, as a real one does."""

    def __init__(self) -> None:
        self.items: list[str | bytes] = []

    async def send(self, item: str | bytes) -> None:
        self.items.append(item)
        await asyncio.sleep(0)

    @property
    def frames(self) -> list[bytes]:
        return [i for i in self.items if isinstance(i, bytes)]

    def events(self, kind: str) -> list[dict]:
        return [e for e in (json.loads(i) for i in self.items if isinstance(i, str)) if e["type"] == kind]


async def never(_item) -> None:
    """A listener whose socket stopped draining: its first send never completes."""
    await asyncio.Event().wait()


def test_a_stalled_listener_is_dropped_and_the_speaker_gets_every_frame():
    async def scenario():
        rt = Runtime(make_settings())
        speaker = Sink()
        session = open_session(rt, lambda message: speaker.send(wire(message)))
        rt.channels.speak("main", session.id)
        healthy_sink = Sink()
        healthy, stalled = Listener(healthy_sink.send, healthy_sink.send), Listener(never, never)
        assert rt.channels.add_listener("main", healthy) and rt.channels.add_listener("main", stalled)
        tasks = [asyncio.create_task(t) for t in (healthy.run_sender(), stalled.run_sender())]
        sender = asyncio.create_task(session.run_sender())
        frames = [bytes([i % 256]) * 9600 for i in range(3 * LISTENER_QUEUE_MAX)]  # 200 ms frames
        for frame in frames:
            await session.outbox.put(AudioFrame(frame))
        await session.outbox.put(None)
        await sender
        await asyncio.sleep(0)  # the healthy listener takes its last frame
        for task in tasks:
            task.cancel()
        return rt, speaker, healthy_sink, stalled, frames

    rt, speaker, healthy, stalled, frames = asyncio.run(scenario())
    assert speaker.frames == frames  # every frame, in order
    assert healthy.frames == frames
    assert stalled.dropped.is_set()
    assert rt.metrics.registry.get_sample_value("voicebot_listeners_dropped_total", {"reason": "fell_behind"}) == 1
    assert rt.channels.listener_count == 1  # the healthy one
    assert rt.metrics.active_listeners._value.get() == 1


def test_a_listener_whose_send_never_completes_is_dropped_as_stalled(monkeypatch):
    """Its queue has room (one message in it), but the socket has taken nothing for the send timeout."""
    monkeypatch.setattr(channels, "LISTENER_SEND_TIMEOUT_S", 0.2)

    async def scenario():
        rt = Runtime(make_settings())
        listener = Listener(never, never)
        assert rt.channels.add_listener("main", listener)  # its listener.ready is the one send
        await asyncio.wait_for(listener.run_sender(), timeout=5)
        return rt, listener

    rt, listener = asyncio.run(scenario())
    assert listener.dropped.is_set()
    assert rt.metrics.registry.get_sample_value("voicebot_listeners_dropped_total", {"reason": "stalled"}) == 1
    assert rt.channels.listener_count == 0


class PingingListenerSocket:
    """A listener's socket that sends `pings` pings and takes nothing: its first send never completes."""

    def __init__(self, pings: int) -> None:
        self.received = [{"type": "websocket.receive", "text": json.dumps({"type": "ping", "id": i})} for i in range(pings)]
        self.closed_with: int | None = None

    async def receive(self) -> dict:
        if self.received:
            return self.received.pop(0)
        await asyncio.Event().wait()  # then it only waits

    send_text = send_bytes = send_json = staticmethod(never)

    async def close(self, code: int, reason: str = "") -> None:
        self.closed_with = code


def test_a_listener_with_no_room_for_its_pong_is_dropped_and_counted():
    """Its pongs go through its queue: once the queue is full, one more is not discarded unsaid but
    drops the listener as fallen behind (counted once, however many pings come)."""
    async def scenario():
        rt = Runtime(make_settings())
        socket = PingingListenerSocket(LISTENER_QUEUE_MAX + 5)
        await asyncio.wait_for(channels.run_listener(socket, rt.channels, "main"), timeout=5)
        return rt, socket

    rt, socket = asyncio.run(scenario())
    assert socket.closed_with == CloseCode.TOO_SLOW
    assert rt.metrics.registry.get_sample_value("voicebot_listeners_dropped_total", {"reason": "fell_behind"}) == 1
    assert rt.channels.listener_count == 0


def test_speakers_come_and_go_listeners_stay():
    async def scenario():
        rt = Runtime(make_settings(server={"max_listeners": 1}))
        sink = Sink()
        listener = Listener(sink.send, sink.send)
        hub = rt.channels
        assert hub.add_listener("show", listener)
        assert not hub.add_listener("show", Listener(sink.send, sink.send))  # over max_listeners
        hub.speak("show", "old")
        hub.speak("show", "new")  # a reconnected client takes the channel over
        hub.mirror("old", json.dumps({"type": "asr.final", "text": "from the old session"}))
        hub.mirror("new", json.dumps({"type": "asr.final", "text": "from the new session"}))
        hub.leave("old")  # no longer the speaker: nothing happens
        hub.leave("new")
        while not listener.queue.empty():
            await sink.send(listener.queue.get_nowait())
        hub.remove_listener("show", listener)
        return hub, sink

    hub, sink = asyncio.run(scenario())
    assert sink.events("listener.ready")[0]["speaking"] is False
    assert [e["speaking"] for e in sink.events("channel.speaker")] == [True, True, False]
    assert [e["text"] for e in sink.events("asr.final")] == ["from the new session"]
    assert hub.listener_count == 0 and not hub._channels  # nothing kept for an empty channel


def test_a_speaker_that_loses_its_channel_is_told_and_no_longer_heard():
    """The host's client comes back as a new session with its resume token: the old session is told
    (`channel_lost`, on its own outbox) and from then on nothing it is sent reaches the listeners."""
    async def scenario():
        rt = Runtime(make_settings())
        hub, sink = rt.channels, Sink()
        listener = Listener(sink.send, sink.send)
        host, back = open_session(rt, never), open_session(rt, never)  # their clients get nothing here
        assert hub.add_listener("show", listener)
        await hub.claim("show", host.id, owner="host-token", tell=host.outbox.error)
        hub.mirror(host.id, b"host before")
        await hub.claim("show", back.id, owner="back-token", resumed_from="host-token", tell=back.outbox.error)
        told = await asyncio.wait_for(host.outbox.get(), 5)
        hub.mirror(host.id, b"host after")  # its reply goes on, to its own client only
        hub.mirror(back.id, b"back")
        hub.leave(host.id)  # its old socket closes at last: the channel stays the new session's
        with pytest.raises(ChannelRefused):  # nor can it take the channel back
            await hub.claim("show", host.id, owner="host-token", tell=host.outbox.error)
        while not listener.queue.empty():
            await sink.send(listener.queue.get_nowait())
        return rt, payload(told), back.outbox, sink

    rt, told, back_outbox, sink = asyncio.run(scenario())
    assert told["type"] == "error" and told["code"] == "channel_lost"
    assert told["channel"] == "show" and told["reason"] == "resumed"
    assert "resume token" in told["message"] and "close this one" in told["message"]
    assert sink.frames == [b"host before", b"back"]
    assert [e["speaking"] for e in sink.events("channel.speaker")] == [True, True]  # no "gone" while back speaks
    assert back_outbox.empty()  # the winner is told nothing
    assert rt.metrics.registry.get_sample_value("voicebot_channel_speakers_lost_total", {"reason": "resumed"}) == 1
    assert rt.metrics.registry.get_sample_value("voicebot_errors_total", {"code": "channel_lost"}) == 1


def test_listener_over_the_socket(server):
    async def scenario():
        url = f"{server.ws_url}?role=listener&channel=lobby"
        async with websockets.connect(url, max_queue=None) as listener:  # see frontends/test_obs_plugin.py
            ready = json.loads(await listener.recv())
            await listener.send(json.dumps({"type": "say", "text": "hi"}))  # listeners cannot speak
            refused = json.loads(await listener.recv())
            async with websockets.connect(server.ws_url, max_queue=None) as speaker:  # it reads nothing
                await speaker.send(json.dumps({"type": "session.start", "channel": "lobby"}))
                for i in range(0, len(pcm := speech_pcm("hello there how are you")), 3200):
                    await speaker.send(pcm[i : i + 3200])
                    await asyncio.sleep(0.05)  # twice real time
                events = []
                while not any(e["type"] == "audio.end" for e in events):
                    message = await asyncio.wait_for(listener.recv(), 20)
                    if isinstance(message, str):
                        events.append(json.loads(message))
        async with websockets.connect(f"{server.ws_url}?role=listener&channel=not%20valid") as bad:
            error = json.loads(await bad.recv())
            with contextlib.suppress(websockets.ConnectionClosed):
                await bad.recv()
        return ready, refused, events, error, bad.close_code

    ready, refused, events, error, close_code = asyncio.run(scenario())
    assert ready == {"type": "listener.ready", "channel": "lobby", "speaking": False, "protocol_version": 1}
    assert refused["code"] == "read_only"
    kinds = [e["type"] for e in events]
    assert kinds[0] == "channel.speaker" and "session.ready" in kinds
    assert [e["text"] for e in events if e["type"] == "asr.final"] == ["hello there how are you"]
    assert kinds.index("reply.done") < kinds.index("audio.start") < kinds.index("audio.end")
    assert error["code"] == "invalid_message" and close_code == CloseCode.POLICY


def masked_text_frame(text: str) -> bytes:
    """One client-to-server WebSocket text frame (RFC 6455: masked; an all-zero mask leaves the payload as is)."""
    payload = text.encode()
    assert 126 <= len(payload) < 1 << 16
    return bytes([0x81, 0x80 | 126]) + len(payload).to_bytes(2, "big") + bytes(4) + payload


def test_a_listener_whose_client_never_reads_is_dropped_and_counted(server, monkeypatch):
    # A real socket whose client never reads, with a small receive buffer so that the server's send
    # blocks within a few hundred KB. It asks for pongs: each goes through the listener's sender, so
    # either the stalled send ends it or, if pongs come faster than the send timeout, the full queue
    # (which of the two depends on this box's speed; both are counted). Before, nothing did until
    # uvicorn's keepalive (~40 s), uncounted.
    monkeypatch.setattr(channels, "LISTENER_SEND_TIMEOUT_S", 1.0)

    def dropped_now() -> float:
        return sum(server.runtime.metrics.registry.get_sample_value("voicebot_listeners_dropped_total", {"reason": r}) or 0
                   for r in channels.DROPPED_BECAUSE)

    before = dropped_now()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", server.settings.server.port))
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        client.sendall((f"GET /v1/voice?role=listener&channel=unread HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                        "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += client.recv(1)  # the handshake only, a byte at a time: nothing after it is read
        assert head.startswith(b"HTTP/1.1 101"), head
        client.setblocking(False)
        ping = masked_text_frame(json.dumps({"type": "ping", "id": "x" * 256}))
        deadline, sent, unsent = time.monotonic() + 30, 0, b""
        while time.monotonic() < deadline:  # bounded: the drop comes within seconds, or the test fails
            try:
                frame = unsent or ping
                unsent = frame[client.send(frame):]  # a partial send is finished before the next frame
                sent += not unsent
                if sent % 1000:
                    continue
            except BlockingIOError:  # the server stopped reading too (its sends to us block)
                time.sleep(0.01)
            if dropped_now() > before:
                break
    finally:
        client.close()
    print(f"\n{sent} pings sent; dropped {time.monotonic() - deadline + 30:.1f} s after the handshake")
    assert dropped_now() == before + 1, "the listener that never reads was not dropped within 30 s"
    assert server.on_loop(lambda: server.runtime.channels.listener_count) == 0
