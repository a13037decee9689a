"""A recorder of what sessions received, for tests and troubleshooting (off unless configured).

With `server.record_input_s` > 0 every session's binary input is kept exactly as it was accepted
(s16le mono at the session's declared rate, before any resampling), up to that many seconds, for
the most recent RECORDED_SESSIONS sessions; GET /debug/input/{session_id}.wav returns it. It
answers "what did the server actually get from this client?", e.g. whether a browser's echo
cancellation changed the microphone signal.
"""

from __future__ import annotations

import io
import wave
from collections import OrderedDict

# Bound: RECORDED_SESSIONS x record_input_s x 96 KB/s at 48 kHz; 8 x 60 s = 46 MB at the very most.
RECORDED_SESSIONS = 8


class InputRecorder:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._recordings: OrderedDict[str, tuple[int, bytearray]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    def record(self, session_id: str, sample_rate: int, pcm: bytes) -> None:
        if not self.enabled:
            return
        if session_id not in self._recordings:
            self._recordings[session_id] = (sample_rate, bytearray())
            while len(self._recordings) > RECORDED_SESSIONS:
                self._recordings.popitem(last=False)
        rate, buffer = self._recordings[session_id]
        room = int(self.seconds * rate) * 2 - len(buffer)
        buffer += pcm[: max(0, room)]

    def wav(self, session_id: str) -> bytes | None:
        if session_id not in self._recordings:
            return None
        rate, buffer = self._recordings[session_id]
        out = io.BytesIO()
        with wave.open(out, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(bytes(buffer))
        return out.getvalue()
