"""Whole audio files (uploads, FunASR offline files) decoded to the recognizers' 16 kHz mono float32.

libsndfile (through soundfile) decodes every format it was built with: wav, flac, ogg, and mp3
since libsndfile 1.1, which soundfile's wheels bundle. No ffmpeg: formats libsndfile lacks (aac,
m4a, opus in mp4, ...) are refused by name.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile

from voicebot.audio.resample import StreamResampler

SAMPLE_RATE = 16000

# Format names as clients send them (file extensions, lower case); "raw" has no header to read.
FILE_FORMATS = frozenset(name.lower() for name in soundfile.available_formats()) - {"raw"}


class UndecodableAudio(ValueError):
    """The bytes are not an audio file libsndfile can read."""


def decode_file(data: bytes) -> tuple[np.ndarray, float]:
    """A whole file as 16 kHz mono float32 (channels averaged), and its duration in seconds.

    Blocking (a long mp3 takes a while): call it off the event loop.
    """
    try:
        audio, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        raise UndecodableAudio(f"not an audio file libsndfile can decode ({len(data)} bytes): {exc}") from exc
    resampler = StreamResampler(rate, SAMPLE_RATE)
    mono = audio.mean(axis=1)
    return np.concatenate([resampler.process(mono), resampler.flush()]), len(audio) / rate
