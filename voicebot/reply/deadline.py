"""The reply stage's deadline around any responder: a total one, and an idle one between pieces of text.

A responder is any code that yields text (a plugin, a future engine); one that hangs would hold the
reply, and with it every later turn of the session, for ever. `within_deadline` bounds the wait for
each piece: past the idle limit (after the first piece; before it only the total limit applies, since
a responder may think before it speaks) or past the total limit it closes the responder's stream and
raises ResponderError (`idle_timeout`, `total_timeout`), which the reply stage reports like any other
responder failure. The OpenAI-compatible responder has the same limits inside, per request, where
it also retries; this is the bound the stage keeps whatever the responder does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from voicebot.reply.base import ResponderError


async def within_deadline(deltas: AsyncIterator[str], idle_timeout_s: float, total_timeout_s: float) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total_timeout_s
    spoke = False
    async with contextlib.aclosing(deltas):
        while True:
            limit, kind, message = deadline, "total_timeout", f"no complete reply within {total_timeout_s:g} s"
            if spoke and loop.time() + idle_timeout_s < deadline:
                limit, kind, message = loop.time() + idle_timeout_s, "idle_timeout", f"no more reply text for {idle_timeout_s:g} s"
            timeout = asyncio.timeout_at(limit)
            try:
                async with timeout:
                    delta = await anext(deltas)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not timeout.expired():  # the responder's own, not our deadline
                    raise
                raise ResponderError(kind, message) from None
            spoke = True
            yield delta
