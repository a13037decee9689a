"""transport.receive_loop: messages in order, ended at once by one of `until` while it waits and after
the message in hand while it handles one, and a cancel from outside still a cancel."""

from __future__ import annotations

import asyncio

import pytest

from voicebot.transport import receive_loop


class QueueSocket:
    """A socket whose messages the test puts; receive waits for the next."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict] = asyncio.Queue()

    async def receive(self) -> dict:
        return await self.messages.get()


def test_messages_in_order_then_until_ends_the_wait_at_once():
    async def main():
        ws, got, stop = QueueSocket(), [], asyncio.get_running_loop().create_future()

        async def on_message(data):
            got.append(data)

        for data in (b"a", "b", b"c"):
            ws.messages.put_nowait({"type": "websocket.receive", **({"bytes": data} if isinstance(data, bytes) else {"text": data})})
        loop_task = asyncio.create_task(receive_loop(ws, on_message, until=(stop,)))
        await asyncio.sleep(0.01)  # all three handled, now waiting
        stop.set_result(None)
        await asyncio.wait_for(loop_task, 1)
        return got, loop_task.cancelling()

    got, cancelling = asyncio.run(main())
    assert got == [b"a", "b", b"c"] and cancelling == 0


def test_until_done_while_a_message_is_handled_ends_it_after_that_message():
    async def main():
        ws, got = QueueSocket(), []
        stop = asyncio.get_running_loop().create_future()

        async def on_message(data):
            stop.set_result(None)  # e.g. a close requested by this very message
            await asyncio.sleep(0.01)
            got.append(data)

        ws.messages.put_nowait({"type": "websocket.receive", "bytes": b"a"})
        ws.messages.put_nowait({"type": "websocket.receive", "bytes": b"b"})
        await asyncio.wait_for(receive_loop(ws, on_message, until=(stop,)), 1)
        return got

    assert asyncio.run(main()) == [b"a"]


def test_a_cancel_from_outside_is_not_taken_for_until():
    async def main():
        ws, stop = QueueSocket(), asyncio.get_running_loop().create_future()

        async def on_message(data):
            pass

        loop_task = asyncio.create_task(receive_loop(ws, on_message, until=(stop,)))
        await asyncio.sleep(0.01)
        loop_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop_task

    asyncio.run(main())
