"""The requests sessions submit to the device scheduler (voicebot/serving/scheduler.py), and how
the scheduler's thread answers them on the session's event loop (asyncio futures, resolved with
`loop.call_soon_threadsafe`; nothing polls):

- `OpenRow`: an LM slot for a new utterance (waits while all slots are in use);
- `Call`: small blocking work on the models' thread (start a program, push a sentence's text);
- `Decode`: up to n speech tokens of an LM row; the row's long steps (prefills) are fed in chunks;
- `Render`: one chunk of a session's audio (a flow + vocoder chunk: Token2WavStream.next_chunk).

A request's deadline is when that session's listener runs out of audio; a new reply's has already
passed, so its first chunk goes first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from voicebot.serving.model_interfaces import DecodeRow


class Overloaded(RuntimeError):
    """More requests are waiting than the scheduler's bound."""


class SchedulerFault(RuntimeError):
    """The scheduler's loop was broken while it held this request; the request is lost, the loop goes on."""


@dataclass(eq=False)
class Request:
    deadline: float  # time.monotonic() when the session's listener runs out of audio
    future: asyncio.Future = field(init=False)
    submitted: float = field(init=False, default_factory=time.monotonic)


@dataclass(eq=False)
class OpenRow(Request):
    sampler: Any  # the model's (a cosyvoice2 Sampler)
    prefix: Any = None  # the model's prompt prefix, copied into the slot (a cosyvoice2 PromptPrefix)
    row: DecodeRow | None = None  # the slot opened for it, once opened


@dataclass(eq=False)
class Call(Request):
    fn: Callable[[], Any]


@dataclass(eq=False)
class Decode(Request):
    row: DecodeRow
    max_tokens: int
    tokens: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Render(Request):
    chunk: Any  # what `render` takes, one per session: a Token2Wav ChunkRequest
    held: int = 0  # LM steps it has waited for others to join it


def resolve(future: asyncio.Future, result: Any, exc: BaseException | None, undo: Callable[[], None] | None) -> None:
    """On the loop: answer the future; `undo` when what it holds is not delivered (the future was
    cancelled, or it is answered with an error). A future answered already (before a thread fault)
    keeps its answer."""
    if future.cancelled():
        if undo is not None:
            undo()
    elif future.done():
        return
    elif exc is not None:
        future.set_exception(exc)
        if undo is not None:
            undo()
    else:
        future.set_result(result)
