"""Whole audio files (uploads, FunASR offline files) decoded to the recognizers' 16 kHz mono float32.

FFmpeg, through PyAV (whose wheels bundle it), decodes whatever it recognizes in the bytes,
whatever name the client gave the format: wav, mp3, flac, ogg/opus/vorbis, m4a/mp4/aac, webm,
aiff, ... Only audio demuxers are opened (`DEMUXERS`): never a playlist or a concat list, which
would have FFmpeg open other files or URLs named inside the upload.

What the header says is checked before any decoding (a WAV that says 1 Hz, or 10 hours, is refused
at once, not resampled into gigabytes first): the sample rate (`MIN_RATE`-`MAX_RATE`), the channels
(at most `MAX_CHANNELS`) and the duration (at most the caller's `max_duration_s`). A header can
lie or say nothing of the length, so the decoded length is counted too and decoding stops as
soon as it passes the limit: the memory a file costs is bounded by the limit, not by the file.
"""

from __future__ import annotations

import io
import itertools

import av
import numpy as np

from voicebot.audio.resample import StreamResampler

SAMPLE_RATE = 16000

MIN_RATE = 8000  # telephone audio; below it there is no speech band left to recognize
MAX_RATE = 384000  # the highest rate audio interfaces record at
MAX_CHANNELS = 32
# The default limit: an hour of audio is 230 MB as 16 kHz float32. Routes may set a smaller one.
MAX_DURATION_S = 3600.0

# FFmpeg's demuxers for audio files (names as FFmpeg's format_whitelist matches them).
DEMUXERS = ("wav", "w64", "mp3", "flac", "ogg", "mov", "matroska", "aac", "aiff", "caf", "au", "amr", "wv",
            "asf", "avi")
# Format names as clients send them (FunASR's wav_format, file extensions): every one is decoded by
# content all the same, so this only tells a file format from a raw stream ("pcm").
FILE_FORMATS = frozenset({"wav", "mp3", "flac", "ogg", "oga", "opus", "m4a", "mp4", "aac", "webm", "mka", "aiff",
                          "aif", "caf", "au", "amr", "wv", "wma", "avi", "others"})


class UndecodableAudio(ValueError):
    """The bytes are not an audio file FFmpeg can read, or not one this server takes."""


class AudioTooLong(UndecodableAudio):
    """The file is longer than the limit (from its header, or found while decoding)."""


def decode_file(data: bytes, max_duration_s: float = MAX_DURATION_S) -> tuple[np.ndarray, float]:
    """A whole file as 16 kHz mono float32 (channels averaged), and its duration in seconds.

    Blocking (a long mp3 takes a while): call it off the event loop.
    """
    try:
        with av.open(io.BytesIO(data), mode="r", options={"format_whitelist": ",".join(DEMUXERS)}) as container:
            if not container.streams.audio:
                raise UndecodableAudio(f"no audio stream in this {container.format.name} file")
            stream = container.streams.audio[0]
            rate, channels = _checked_header(container, stream, max_duration_s)
            return _decoded(container, stream, rate, max_duration_s)
    except UndecodableAudio:
        raise
    except (av.error.FFmpegError, ValueError) as exc:  # ValueError: PyAV's own complaints
        # FFmpeg's own words (strerror), not the exception's str, which names the Python file object.
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise UndecodableAudio(f"not an audio file FFmpeg can decode ({len(data)} bytes): {reason}") from None


def _checked_header(container, stream, max_duration_s: float) -> tuple[int, int]:
    """The stream's rate and channels as its header says, refused if out of bounds."""
    rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
    if not MIN_RATE <= rate <= MAX_RATE:
        raise UndecodableAudio(f"its sample rate is {rate} Hz; files from {MIN_RATE} to {MAX_RATE} Hz are taken")
    if not 1 <= channels <= MAX_CHANNELS:
        raise UndecodableAudio(f"it has {channels} channels; at most {MAX_CHANNELS} are taken")
    if stream.duration is not None and stream.time_base is not None:
        declared = float(stream.duration * stream.time_base)
    else:
        declared = container.duration / av.time_base if container.duration else 0.0
    if declared > max_duration_s:
        raise AudioTooLong(f"it is {declared:.0f} s long; the limit is {max_duration_s:.0f} s")
    return rate, channels


def _decoded(container, stream, rate: int, max_duration_s: float) -> tuple[np.ndarray, float]:
    to_float = av.AudioResampler(format="fltp", layout=stream.codec_context.layout, rate=rate)
    resampler = StreamResampler(rate, SAMPLE_RATE)
    limit, frames, pieces = int(max_duration_s * rate), 0, []
    for frame in itertools.chain(container.decode(stream), [None]):  # None: what the converter still holds
        for planar in to_float.resample(frame):
            mono = planar.to_ndarray().mean(axis=0)  # (channels, samples): channels averaged
            frames += len(mono)
            if frames > limit:
                raise AudioTooLong(f"it is over the limit of {max_duration_s:.0f} s (found while decoding)")
            pieces.append(resampler.process(mono))
    pieces.append(resampler.flush())
    return np.concatenate(pieces).astype(np.float32, copy=False), frames / rate
