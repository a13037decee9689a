"""What the character says of a reply: the responder's text, filtered, or a fallback line.

When the responder fails before saying anything, the character speaks `fallback_line` instead of
going silent; when it fails in mid-reply, the reply ends with what was already said (a fallback
line after half a sentence would sound stranger than the stop). Either way `on_failure` hears of
it, so the session can send an `error` event and count it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator, Awaitable, Callable

from voicebot.reply.base import ResponderError
from voicebot.reply.safety import Scrubber, SpeechFilter

log = logging.getLogger("voicebot.reply")


async def spoken(
    deltas: AsyncIterator[str],
    speech_filter: SpeechFilter,
    fallback_line: str,
    on_failure: Callable[[ResponderError], Awaitable[None]],
    scrubber: Scrubber | None = None,
) -> AsyncIterator[str]:
    said = False
    try:
        async with contextlib.aclosing(speech_filter.apply(deltas, scrubber)) as texts:
            async for text in texts:
                said = True
                yield text
    except Exception as exc:  # any responder failure, bugs included: the show goes on
        if not isinstance(exc, ResponderError):
            log.exception("responder failed")
            exc = ResponderError("internal", f"{type(exc).__name__}: {exc}")
        await on_failure(exc)
        if not said and fallback_line:
            yield fallback_line
