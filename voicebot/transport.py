"""The socket code, in one place: the receive loop every WebSocket endpoint runs.

A client goes away in one of three ways, and each endpoint used to catch a different subset:
the ASGI disconnect message, `WebSocketDisconnect` (raised by starlette's receive, or by a send
to a client that is gone), and `RuntimeError` from calling a socket that is already closed.
`receive_loop` ends quietly on all three, whether they come out of the receive or out of a send
made while handling a message; a RuntimeError while the socket is still open is a bug and is
raised. Users: /v1/voice (speaker and listener), /obs/audio, /funasr (and the next protocol).

A text frame that is not UTF-8 never reaches the app: RFC 6455 (8.1) has the server fail the
connection, and the websockets library does, with close 1007 ("invalid frame payload data"), which
is the client's answer. uvicorn's sans-I/O WebSocket logs a traceback for each such frame;
`one_line_for_invalid_utf8` keeps it to its one line, so a client cannot fill the log with them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Protocol

from starlette.websockets import WebSocketDisconnect, WebSocketState

Wire = str | bytes  # one WebSocket message: text or binary
MessageHandler = Callable[[Wire], Awaitable[None]]


class Socket(Protocol):
    """What the loop and the front ends use of a starlette WebSocket."""

    client_state: WebSocketState
    application_state: WebSocketState

    async def receive(self) -> dict: ...

    async def send_text(self, data: str) -> None: ...

    async def send_bytes(self, data: bytes) -> None: ...


def is_closed(ws: Socket) -> bool:
    return WebSocketState.DISCONNECTED in (ws.client_state, ws.application_state)


async def receive_loop(ws: Socket, on_message: MessageHandler, *, until: Collection[asyncio.Future] = ()) -> None:
    """Hand each text or binary message to `on_message`, in order, until the client goes away
    or one of `until` (e.g. the sender task, a close request) is done: while waiting for a message,
    at once; while handling one, once it is handled.

    The wait is the socket's own receive, in this task: one of `until` done meanwhile cancels it
    (a done-callback, set once). Not a task and an asyncio.wait per message: with 16 live speakers'
    20 ms chunks, that cost the event loop 30-70 µs a message, under the GIL every session's input
    shares (voicebot/serving/input_clock.py)."""
    task = asyncio.current_task()
    receiving = interrupted = False

    def interrupt(_: asyncio.Future) -> None:
        nonlocal interrupted
        if receiving and not interrupted:
            interrupted = True
            task.cancel()

    for future in until:
        future.add_done_callback(interrupt)
    try:
        while not any(f.done() for f in until):
            receiving = True
            try:
                message = await ws.receive()
            except asyncio.CancelledError:
                if interrupted and task.uncancel() == 0:  # ours alone, not the caller's too
                    return
                raise
            finally:
                receiving = False
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") is not None:
                await on_message(message["text"])
            elif message.get("bytes") is not None:
                await on_message(message["bytes"])
    except WebSocketDisconnect:
        return
    except RuntimeError:
        if is_closed(ws):
            return
        raise
    finally:
        for future in until:
            future.remove_done_callback(interrupt)


class _OneLineForInvalidUtf8(logging.Filter):
    """uvicorn's "Invalid UTF-8 sequence received from client." without its traceback: the
    client's fault, answered with close 1007, not a server error to debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.getMessage().startswith("Invalid UTF-8 sequence received from client"):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def one_line_for_invalid_utf8() -> None:
    """Install the filter on uvicorn's error log (idempotent)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _OneLineForInvalidUtf8) for f in logger.filters):
        logger.addFilter(_OneLineForInvalidUtf8())
