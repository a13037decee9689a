"""Test audio made offline: espeak-ng speech, fan-like background noise, clicks and bumps."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from voicebot.audio.resample import StreamResampler
from voicebot.config.base import REPO_ROOT

# A directory for synthesized speech shared by the processes of one test run (tests/conftest.py
# makes one per run; pytest-xdist's workers inherit it), so each sentence is synthesized once.
SPEECH_DIR_ENV = "VOICEBOT_TEST_SPEECH_DIR"


@functools.lru_cache(maxsize=64)
def espeak_speech(text: str, voice: str = "en-us", rate: int = 16000) -> np.ndarray:
    """espeak-ng speech as float32 at `rate`, peak-normalised to 0.5.

    Synthesized in a fresh process: espeak-ng carries state from one synthesis to the next (the
    same sentence comes out a little different each time), so test audio made in-process would
    depend on what ran before it.

    Kept in memory, and on disk in $VOICEBOT_TEST_SPEECH_DIR when it is set: the same fresh-process
    synthesis, made once for all the processes of a test run.
    """
    shared = os.environ.get(SPEECH_DIR_ENV)
    if not shared:
        return _synthesize(text, voice, rate)
    path = Path(shared) / (hashlib.sha256(repr((text, voice, rate)).encode()).hexdigest() + ".npy")
    if path.exists():
        return np.load(path)
    audio = _synthesize(text, voice, rate)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # two workers may make the same sentence at once
    with open(partial, "wb") as f:
        np.save(f, audio)
    os.replace(partial, path)
    return audio


def _synthesize(text: str, voice: str, rate: int) -> np.ndarray:
    script = (
        "import sys, threading; from voicebot.tts.espeak import _Library; lib = _Library.get(); "
        "sys.stdout.write(str(lib.rate) + '\\n'); sys.stdout.flush(); "
        "sys.stdout.buffer.write(lib.synthesize(sys.argv[1], sys.argv[2], 175, threading.Event()).tobytes())"
    )
    out = subprocess.run([sys.executable, "-c", script, text, voice], capture_output=True, check=True, cwd=REPO_ROOT).stdout
    header, _, body = out.partition(b"\n")
    native = np.frombuffer(body, np.float32)
    resampler = StreamResampler(int(header), rate)
    audio = np.concatenate([resampler.process(native), resampler.flush()])
    return (audio * (0.5 / max(1e-9, np.abs(audio).max()))).astype(np.float32)


def to_pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def dbfs_gain(audio: np.ndarray, target_dbfs: float, mask: np.ndarray | None = None) -> np.ndarray:
    """Scale so the RMS (over `mask` when given) is `target_dbfs` (0 dBFS = full-scale RMS 1)."""
    rms = np.sqrt(np.mean(audio[mask] ** 2 if mask is not None else audio**2))
    return (audio * (10 ** (target_dbfs / 20) / rms)).astype(np.float32)


def fan_noise(n: int, rng: np.random.Generator, dbfs: float, rate: int = 16000) -> np.ndarray:
    """Low-passed noise plus a blade hum with a slow wobble: a fan, not white noise."""
    from scipy.signal import lfilter

    pink = lfilter([0.08], [1.0, -0.92], rng.standard_normal(n))  # one-pole low-pass
    t = np.arange(n) / rate
    hum = 0.4 * np.sin(2 * np.pi * 120 * t) * (1 + 0.2 * np.sin(2 * np.pi * 0.7 * t))
    noise = pink / pink.std() + hum
    return dbfs_gain(noise, dbfs)


def impulse(kind: str, duration_ms: float, peak_dbfs: float, rng: np.random.Generator, rate: int = 16000) -> np.ndarray:
    """A click (noise burst with a fast decay), a clap (longer noisy burst) or a bump (damped thump)."""
    n = max(2, int(rate * duration_ms / 1000))
    t = np.arange(n) / rate
    if kind == "bump":
        wave = np.sin(2 * np.pi * rng.uniform(40, 90) * t + rng.uniform(0, np.pi))
    else:
        wave = rng.standard_normal(n)
    envelope = np.exp(-t / (duration_ms / 1000 / (4 if kind != "clap" else 2)))
    x = wave * envelope
    return (x * (10 ** (peak_dbfs / 20) / np.abs(x).max())).astype(np.float32)
