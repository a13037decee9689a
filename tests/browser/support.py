"""Audio the browser tests speak: espeak sentences with pauses, as a wav file or OBS plugin messages."""

from __future__ import annotations

import struct
import time
from collections import deque
from pathlib import Path

import numpy as np
import soundfile

from tests.audio import espeak_speech


def speech(*parts: str | float, rate: int = 16000) -> np.ndarray:
    """Concatenate espeak sentences (str) and silences (float seconds) at `rate`."""
    pieces = [np.zeros(int(p * rate), np.float32) if isinstance(p, float) else espeak_speech(p, rate=rate) for p in parts]
    return np.concatenate(pieces)


def write_wav(path: Path, audio: np.ndarray, rate: int = 16000) -> Path:
    soundfile.write(str(path), audio, rate, subtype="PCM_16")
    return path


class WireLog:
    """What a page's WebSockets carried, with when: each JSON message, and the binary ones (audio)
    between two JSON messages of the same direction as one count. A browser test that fails on a
    wait that timed out says only what did not happen; this, in the failure's report (conftest.py),
    says what the server did instead."""

    MAX_LINES = 1000  # a test's conversation is a few hundred lines; the latest are kept
    MAX_TEXT = 300  # characters of a JSON message shown

    def __init__(self, page) -> None:
        self._t0 = time.monotonic()
        self._lines: deque[list] = deque(maxlen=self.MAX_LINES)  # [seconds, direction, text, binary messages, bytes]
        self._binary_run: dict[str, list] = {}  # direction -> its line counting the binary messages since its last JSON one
        page.on("websocket", self._watch)

    def _watch(self, ws) -> None:
        ws.on("framereceived", lambda payload: self._add("in ", payload))
        ws.on("framesent", lambda payload: self._add("out", payload))

    def _add(self, direction: str, payload: str | bytes) -> None:
        t = time.monotonic() - self._t0
        if isinstance(payload, str):
            self._binary_run.pop(direction, None)
            self._lines.append([t, direction, payload[: self.MAX_TEXT], 0, 0])
            return
        if direction not in self._binary_run:
            self._binary_run[direction] = [t, direction, None, 0, 0]
            self._lines.append(self._binary_run[direction])
        self._binary_run[direction][3] += 1
        self._binary_run[direction][4] += len(payload)

    def text(self) -> str:
        return "\n".join(f"{t:8.3f} s {direction} {text if text is not None else f'{count} binary ({size} bytes) from here on'}"
                          for t, direction, text, count, size in self._lines)


def obs_audio_message(pcm: np.ndarray, rate: int = 48000, timestamp_ns: int = 0, source: str = "Mic/Aux") -> bytes:
    """One binary message as obs-audio-to-websocket sends it: header, source id and name, s16le frames."""
    frames = pcm.reshape(len(pcm), -1)  # (frames, channels)
    name = source.encode()
    header = struct.pack("<QIIIII", timestamp_ns, rate, frames.shape[1], 16, len(name), len(name))
    return header + name + name + (np.clip(frames, -1, 1) * 32767).astype("<i2").tobytes()
