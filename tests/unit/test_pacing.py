import asyncio
import types

import voicebot.pacing

from voicebot.pacing import HeardText, Pacer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_frames_are_held_to_the_lead_over_playback(monkeypatch):
    clock = FakeClock()
    pacer = Pacer(200, 400, clock=clock)
    waits = []

    async def fake_sleep(seconds):
        waits.append(round(seconds, 3))
        clock.now += seconds

    # Only the pacer's sleep: patching asyncio.sleep itself also caught other threads' event loops
    # (a test server still stopping) and recorded their waits too.
    monkeypatch.setattr(voicebot.pacing, "asyncio", types.SimpleNamespace(sleep=fake_sleep))
    async def send(n):
        for _ in range(n):
            await pacer.wait_turn()
            pacer.sent(4800, 24000)

    asyncio.run(send(5))
    # Frames 0-2 go at once (up to 400 ms ahead), then one every 200 ms.
    assert waits == [0.2, 0.2]
    assert pacer.underruns == 0
    assert round(pacer.played_ms(), 6) == 400.0


def test_late_frame_counts_as_underrun():
    clock = FakeClock()
    pacer = Pacer(200, 400, clock=clock)
    pacer.sent(4800, 24000)
    clock.now += 0.5  # the client played its 200 ms and waited 300 ms more
    pacer.sent(4800, 24000)
    assert pacer.underruns == 1


def test_heard_text_keeps_whole_sentences_and_the_played_part_of_the_current_one():
    heard = HeardText()
    heard.add("Hello there.", 0, 0, 24000)
    heard.add("How are you doing today?", 1, 24000, 48000)
    assert heard.heard(0) == ""
    assert heard.heard(24000) == "Hello there."
    assert heard.heard(24000 + 24000) == "Hello there. How are you"
    assert heard.heard(10**9) == "Hello there. How are you doing today?"


def test_heard_text_cuts_chinese_by_characters_and_joins_without_spaces():
    heard = HeardText()
    heard.add("你好。", 0, 0, 3000)
    heard.add("我是主播。", 1, 3000, 5000)
    assert heard.heard(3000 + 2000) == "你好。我是"


def test_a_segment_whose_text_grows_is_heard_by_its_latest_text():
    heard = HeardText()  # CosyVoice 2 bistream: one segment voices sentence after sentence
    heard.add("Hello there.", 0, 0, 24000)
    heard.add("Hello there. How are you?", 0, 24000, 24000)
    assert heard.heard(10**9) == "Hello there. How are you?"
    assert heard.heard(24000) == "Hello"  # half its audio: half its text, back to a word boundary
