"""The reply stage's deadline around any responder (voicebot/reply/deadline.py), on the event loop's clock."""

from __future__ import annotations

import asyncio

import pytest

from voicebot.reply.base import ResponderError
from voicebot.reply.deadline import within_deadline


async def paced(deltas: list[tuple[float, str]], closed: list[bool]):
    """Each delta after its pause; records whether it was closed (cancelled or aclose'd) early."""
    try:
        for pause, delta in deltas:
            await asyncio.sleep(pause)
            yield delta
    except (asyncio.CancelledError, GeneratorExit):
        closed.append(True)
        raise


async def collect(deltas, idle_s: float, total_s: float) -> tuple[list[str], ResponderError | None]:
    got: list[str] = []
    try:
        async for delta in within_deadline(deltas, idle_s, total_s):
            got.append(delta)
    except ResponderError as exc:
        return got, exc
    return got, None


@pytest.mark.parametrize("pauses, said, kind", [
    ([0.0, 0.1, 0.1], ["a", "b", "c"], None),  # in time: all of it
    ([0.0, 0.1, 1.5], ["a", "b"], "idle_timeout"),  # a pause after text
    ([1.2, 0.0], [], "total_timeout"),  # thinking past the total before any text (no idle limit before it)
    ([0.0, 0.4, 0.4, 0.4, 0.4], ["a", "b", "c"], "total_timeout"),  # each pause in time, the whole too long
], ids=["in-time", "idle", "silent", "slow-overall"])
def test_the_deadline_cuts_a_responder_and_closes_its_stream(pauses, said, kind):
    closed: list[bool] = []
    deltas = [(pause, text) for pause, text in zip(pauses, "abcde")]
    got, error = asyncio.run(collect(paced(deltas, closed), idle_s=0.6, total_s=1.0))
    assert got == said
    assert (error.kind if error else None) == kind
    assert bool(closed) == (kind is not None)


def test_a_timeout_the_responder_raises_itself_is_its_own_failure():
    async def raises():
        yield "a"
        raise TimeoutError("the plugin's own timeout")

    async def run():
        async for _ in within_deadline(raises(), 1.0, 2.0):
            pass

    with pytest.raises(TimeoutError, match="the plugin's own"):
        asyncio.run(run())
