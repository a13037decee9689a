"""Audio the browser tests speak: espeak sentences with pauses, as a wav file or OBS plugin messages."""

from __future__ import annotations

import struct
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


def obs_audio_message(pcm: np.ndarray, rate: int = 48000, timestamp_ns: int = 0, source: str = "Mic/Aux") -> bytes:
    """One binary message as obs-audio-to-websocket sends it: header, source id and name, s16le frames."""
    frames = pcm.reshape(len(pcm), -1)  # (frames, channels)
    name = source.encode()
    header = struct.pack("<QIIIII", timestamp_ns, rate, frames.shape[1], 16, len(name), len(name))
    return header + name + name + (np.clip(frames, -1, 1) * 32767).astype("<i2").tobytes()
