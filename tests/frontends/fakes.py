"""A session as a front end uses it, for the front ends' tests without sockets or engines."""

from __future__ import annotations

from voicebot.metrics import Metrics
from voicebot.session.outbox import Outbox


class RecordingSession:
    """arrived (refusing every message when `flooding`), handle (recorded), and a real outbox."""

    def __init__(self, flooding: bool = False) -> None:
        self.flooding = flooding
        self.arrivals: list[int] = []
        self.commands: list = []
        self.outbox = Outbox(Metrics())

    def arrived(self, audio_bytes: int = 0) -> bool:
        self.arrivals.append(audio_bytes)
        return not self.flooding

    async def handle(self, command) -> None:
        self.commands.append(command)
