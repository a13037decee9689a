"""The operator console's feed (voicebot/console.py): bounded, and never in a session's way."""

from __future__ import annotations

import json

from voicebot.config import load_settings
from voicebot.console import FEED_QUEUE_MAX, HISTORY_MAX, Console, Feed
from voicebot.runtime import Runtime


def final(text: str) -> str:
    return json.dumps({"type": "asr.final", "utterance_id": "u1", "text": text})


def test_a_console_that_falls_behind_is_dropped_and_counted_and_the_session_never_waits():
    rt = Runtime(load_settings(None))
    console = Console(rt)
    slow, other = Feed(), Feed()
    console._feeds |= {slow, other}
    for i in range(FEED_QUEUE_MAX):
        rt.channels.mirror("s1", final(f"turn {i}"))  # what a session's sender does with each message
    other.queue.get_nowait()  # the other console reads one
    rt.channels.mirror("s1", final("one more"))  # returns at once, with the slow console full
    assert slow.dropped.is_set() and not other.dropped.is_set()
    assert console._feeds == {other}
    assert rt.metrics.registry.get_sample_value("voicebot_console_dropped_total") == 1


def test_each_sessions_history_is_bounded_and_forgotten_once_it_is_gone():
    rt = Runtime(load_settings(None))
    console = Console(rt)
    rt.sessions["s1"] = object()
    for i in range(HISTORY_MAX + 10):
        rt.channels.mirror("s1", final(f"turn {i}"))
        rt.channels.mirror("s1", json.dumps({"type": "asr.partial", "utterance_id": "u1", "text": "live only"}))
    rt.channels.mirror("s1", b"\x00" * 9600)  # reply audio: not the console's
    assert len(console._history["s1"]) == HISTORY_MAX
    assert all(m["event"]["type"] == "asr.final" for m in console._history["s1"])
    del rt.sessions["s1"]
    rt.sessions["s2"] = object()
    rt.channels.mirror("s2", final("hello"))  # a new session: the gone one's history is dropped
    assert list(console._history) == ["s2"]
