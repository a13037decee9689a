"""TurnTaking.next_input: when a client that stops sending is taken to be silent (the wall clock).
The end of a turn through the real server is tests/integration/test_turn_taking.py's."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from voicebot.config import EndpointConfig
from voicebot.messages import AudioIn, InputEnd
from voicebot.metrics import Metrics
from voicebot.session.outbox import Outbox
from voicebot.session.turn_taking import STALL_GRACE_S, TurnTaking

RATE = 16000


def turn_taking(in_utterance: bool = True, session_silence_ms: int = 500) -> TurnTaking:
    # The front end as next_input reads it: no silence heard yet; the endpointer waits the
    # session's silence (session.update may set its own), the server's config says 500 ms.
    endpointer = SimpleNamespace(in_utterance=in_utterance, config=EndpointConfig(endpoint_silence_ms=session_silence_ms))
    front_end = SimpleNamespace(resampler=SimpleNamespace(in_rate=RATE), endpointer=endpointer, silence_ms=0.0)
    metrics = Metrics()

    async def queue_turn(turn):
        raise AssertionError("no turn here")

    return TurnTaking(EndpointConfig(turn="silence", endpoint_silence_ms=500), None, front_end, Outbox(metrics), metrics,
                      queue_turn, lambda turn: None)


def chunk(seconds: float) -> AudioIn:
    return AudioIn(bytes(2 * int(RATE * seconds)), time.monotonic())


def test_a_client_that_stops_mid_utterance_gets_an_input_end_after_the_limit():
    async def run():
        tt, queue = turn_taking(), asyncio.Queue()
        await queue.put(chunk(0.02))
        assert isinstance(await tt.next_input(queue), AudioIn)
        started = time.monotonic()
        item = await asyncio.wait_for(tt.next_input(queue), 5)
        return item, time.monotonic() - started, queue.empty()

    item, waited, empty = asyncio.run(run())
    assert isinstance(item, InputEnd) and empty
    assert waited >= 0.5 + STALL_GRACE_S - 0.05  # the whole limit, then the grace


def test_a_client_sending_long_chunks_is_not_stalled_before_its_next_is_due():
    """1 s chunks: the next arrives 1 s after the last, past the 500 ms limit, and is not late."""
    async def run():
        tt, queue = turn_taking(), asyncio.Queue()
        await queue.put(chunk(1.0))
        assert isinstance(await tt.next_input(queue), AudioIn)
        asyncio.get_running_loop().call_later(0.9, queue.put_nowait, chunk(1.0))
        return await asyncio.wait_for(tt.next_input(queue), 5)

    assert isinstance(asyncio.run(run()), AudioIn)


def test_no_deadline_outside_an_utterance():
    async def run():
        tt, queue = turn_taking(in_utterance=False), asyncio.Queue()
        await queue.put(chunk(0.02))
        await tt.next_input(queue)
        try:
            await asyncio.wait_for(tt.next_input(queue), 0.5 + STALL_GRACE_S + 0.3)
        except TimeoutError:
            return "waited"
        return "returned"

    assert asyncio.run(run()) == "waited"


def test_the_sessions_own_silence_rule_is_the_limit_not_the_servers():
    """/v1/realtime's manual commits set a 5 s wait: a client pausing 1 s is not taken as stopped."""
    async def run():
        tt, queue = turn_taking(session_silence_ms=5000), asyncio.Queue()
        await queue.put(chunk(0.02))
        assert isinstance(await tt.next_input(queue), AudioIn)
        asyncio.get_running_loop().call_later(1.0, queue.put_nowait, chunk(0.02))
        return await asyncio.wait_for(tt.next_input(queue), 5)

    assert isinstance(asyncio.run(run()), AudioIn)
