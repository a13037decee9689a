"""The operator console's feed (voicebot/console.py): fed the sessions' typed events through the
runtime's observer seam, bounded, never in a session's way, and never given a resume token."""

from __future__ import annotations

import json

from voicebot.config import load_settings
from voicebot.console import FEED_QUEUE_MAX, HISTORY_MAX, Console, Feed
from voicebot.messages import AudioFrame
from voicebot.runtime import Runtime
from voicebot.session.events import AsrFinal, AsrPartial, Pong, SessionReady

TOKEN = "resume-0123456789abcdef-secret"


def final(text: str) -> AsrFinal:
    return AsrFinal("u1", {"text": text, "confidence": 0.9}, gate_muted_ms=0, timings={})


def ready() -> SessionReady:
    return SessionReady(session_id="s1", resume_token=TOKEN, protocol_version=1, input_sample_rate=16000,
                        output_sample_rate=24000, frame_ms=200, voice="alloy", responder="echo", resumed=False)


def test_a_console_that_falls_behind_is_dropped_and_counted_and_the_session_never_waits():
    rt = Runtime(load_settings(None))
    console = Console(rt)
    slow, other = Feed(), Feed()
    console._feeds |= {slow, other}
    for i in range(FEED_QUEUE_MAX):
        rt.observe("s1", final(f"turn {i}"))  # what a session's sender does with each message
    other.queue.get_nowait()  # the other console reads one
    rt.observe("s1", final("one more"))  # returns at once, with the slow console full
    assert slow.dropped.is_set() and not other.dropped.is_set()
    assert console._feeds == {other}
    assert rt.metrics.registry.get_sample_value("voicebot_console_dropped_total") == 1


def test_each_sessions_history_is_bounded_and_forgotten_once_it_is_gone():
    rt = Runtime(load_settings(None))
    console = Console(rt)
    rt.sessions["s1"] = object()
    for i in range(HISTORY_MAX + 10):
        rt.observe("s1", final(f"turn {i}"))
        rt.observe("s1", AsrPartial("u1", "live only"))
    rt.observe("s1", AudioFrame(b"\x00" * 9600))  # reply audio: not the console's
    rt.observe("s1", Pong(id=1))  # not an event the console follows
    assert len(console._history["s1"]) == HISTORY_MAX
    assert all(m["event"]["type"] == "asr.final" for m in console._history["s1"])
    del rt.sessions["s1"]
    rt.sessions["s2"] = object()
    rt.observe("s2", final("hello"))  # a new session: the gone one's history is dropped
    assert list(console._history) == ["s2"]


def test_the_console_serializes_the_typed_events_itself_and_never_sends_a_resume_token():
    rt = Runtime(load_settings(None))
    console = Console(rt)
    feed = Feed()
    console._feeds.add(feed)
    rt.observe("s1", ready())
    rt.observe("s1", final("hello there"))
    sent = [json.loads(feed.queue.get_nowait()) for _ in range(2)]
    assert feed.queue.empty()
    assert [m["session"] for m in sent] == ["s1", "s1"]
    assert sent[0]["event"]["type"] == "session.ready" and sent[0]["event"]["voice"] == "alloy"
    assert "resume_token" not in sent[0]["event"] and "session_id" not in sent[0]["event"]
    # A final's hypothesis sits at the top of the event, as on /v1/voice.
    assert sent[1]["event"] == {"type": "asr.final", "utterance_id": "u1", "text": "hello there", "confidence": 0.9,
                                "gate_muted_ms": 0, "timings": {}}
    assert TOKEN not in json.dumps([list(kept) for kept in console._history.values()])
