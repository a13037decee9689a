"""Channels: a session's listeners get what it is sent, and one that stops reading is dropped
without holding the session back (counted in messages, never in time)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import websockets

from tests.conftest import make_settings, speech_pcm
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
    assert rt.metrics.listeners_dropped._value.get() == 1
    assert rt.channels.listener_count == 1  # the healthy one
    assert rt.metrics.active_listeners._value.get() == 1


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
