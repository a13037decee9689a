"""The idle timeout: a connection its client has gone quiet on is closed, so it frees its place.

`Session.expect_start` closes a connection that never starts; this closes one that started and
then sent nothing at all (no audio, no event) for `timeout_s`: a speaking client streams audio
all the time, even silence, so such a client is gone without closing its socket, and would hold
a `max_sessions` place for ever. While `busy()` (the bot is replying) the client is listening, not
gone: the clock starts again when the reply ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# How often the clock is read: the close comes at most this late (or a quarter of the timeout).
CHECK_EVERY_S = 1.0


class IdleWatch:
    def __init__(self, timeout_s: float | None, busy: Callable[[], bool] = lambda: False) -> None:
        self.timeout_s = timeout_s
        self.busy = busy
        self._last_heard = time.monotonic()

    def heard(self) -> None:
        """The client sent something."""
        self._last_heard = time.monotonic()

    async def expire(self) -> str:
        """Return, with the reason, once the client has been quiet for `timeout_s` (never if None)."""
        if self.timeout_s is None:
            await asyncio.Event().wait()  # never set: no timeout, until cancelled
        while True:
            await asyncio.sleep(min(CHECK_EVERY_S, self.timeout_s / 4))
            now = time.monotonic()
            if self.busy():
                self._last_heard = now
            elif now - self._last_heard >= self.timeout_s:
                return f"nothing received for {self.timeout_s:g} s"
