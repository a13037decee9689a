"""A /funasr connection's backlog (voicebot/frontends/funasr_ws.py Backlog): messages in order,
stamped at arrival, the binary ones that waited taken together, its bounds held, nothing lost at
its close (what was left comes back to be counted)."""

from __future__ import annotations

import asyncio
import time

import pytest

from voicebot.frontends import funasr_ws
from voicebot.frontends.funasr_ws import Backlog


def test_binary_messages_that_waited_are_taken_together_up_to_the_next_text_one():
    async def run():
        backlog = Backlog()
        before = time.monotonic()
        for message in (b"a", b"bb", "{}", b"c"):
            assert await backlog.put(message) is None
        first, second, third = await backlog.take(), await backlog.take(), await backlog.take()
        return before, first, second, third, len(backlog)

    before, first, second, third, left = asyncio.run(run())
    assert [r.message for r in first] == [b"a", b"bb"] and [r.message for r in second] == ["{}"]
    assert [r.message for r in third] == [b"c"] and left == 0
    arrivals = [r.arrived for r in (*first, *second, *third)]
    assert arrivals == sorted(arrivals) and arrivals[0] >= before


@pytest.mark.parametrize("bound", ["bytes", "messages"])
def test_a_full_backlog_makes_the_receiver_wait_and_stamps_the_message_before_the_wait(monkeypatch, bound):
    monkeypatch.setattr(funasr_ws, "BACKLOG_BYTES", 10 if bound == "bytes" else 2**20)
    monkeypatch.setattr(funasr_ws, "BACKLOG_MESSAGES", 3 if bound == "messages" else 256)

    async def run():
        backlog = Backlog()
        for message in ([b"12345", b"67890"] if bound == "bytes" else [b"1", b"2", b"3"]):
            await backlog.put(message)
        waiting = asyncio.create_task(backlog.put(b"late"))
        await asyncio.sleep(0.05)
        blocked = not waiting.done()
        room_made = time.monotonic()
        await backlog.take()
        await asyncio.wait_for(waiting, 1)
        rest = await backlog.take()
        return blocked, room_made, rest

    blocked, room_made, rest = asyncio.run(run())
    assert blocked  # over the bound: the receiver waited for room
    assert [r.message for r in rest] == [b"late"]
    assert rest[0].arrived < room_made  # stamped when it came, not when there was room


def test_one_message_bigger_than_the_bound_still_passes(monkeypatch):
    monkeypatch.setattr(funasr_ws, "BACKLOG_BYTES", 4)

    async def run():
        backlog = Backlog()
        await asyncio.wait_for(backlog.put(b"a message of more than four bytes"), 1)
        return await backlog.take()

    assert [r.message for r in asyncio.run(run())] == [b"a message of more than four bytes"]


def test_close_hands_back_what_was_left_and_ends_both_sides(monkeypatch):
    monkeypatch.setattr(funasr_ws, "BACKLOG_MESSAGES", 2)

    async def run():
        backlog = Backlog()
        await backlog.put(b"1")
        await backlog.put(b"2")
        receiver = asyncio.create_task(backlog.put(b"3"))  # waiting for room
        await asyncio.sleep(0.05)
        left = backlog.close()
        kept_out = await asyncio.wait_for(receiver, 1)
        return left, kept_out, await asyncio.wait_for(backlog.take(), 1), len(backlog)

    left, kept_out, taken, size = asyncio.run(run())
    assert [r.message for r in left] == [b"1", b"2"]
    assert kept_out is not None and kept_out.message == b"3"  # returned, to be counted as dropped
    assert taken == [] and size == 0
