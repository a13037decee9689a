"""Synthesized speech encoded as it is made, for /v1/audio/speech's response formats.

`SpeechEncoder(response_format, rate)` takes s16le mono chunks (`encode`) and gives back the bytes
of the format ready to send so far; `finish` gives the rest. The compressed formats are FFmpeg's
encoders through PyAV, each in the container OpenAI sends it in: mp3 (LAME), opus (Ogg), aac
(ADTS), flac. The muxer writes to a sink that is not seekable and flushes after every packet, so
bytes go out as soon as the encoder has a frame of them (a FLAC header is then not rewritten at
the end with the length: players read such a stream to its end). pcm is the samples as they are;
wav is a header whose sizes say "unknown length" (the length is not known when it is sent), then
the samples.
"""

from __future__ import annotations

import struct
import threading

import av
import numpy as np

# response_format -> (FFmpeg muxer, encoder, media type)
# response_format -> (FFmpeg muxer, encoder, media type)
COMPRESSED = {
    "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
    "opus": ("ogg", "libopus", "audio/ogg"),
    "aac": ("adts", "aac", "audio/aac"),
    "flac": ("flac", "flac", "audio/flac"),
}
# Every packet flushed to the sink as it is muxed; Ogg pages of 100 ms, not FFmpeg's 1 s (it holds a
# page until it is full).
MUXER_OPTIONS = {"ogg": {"page_duration": "100000"}}
FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")  # OpenAI's, in its order


def media_type(response_format: str) -> str:
    return COMPRESSED[response_format][2] if response_format in COMPRESSED else f"audio/{response_format}"


def wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length (RIFF and data sizes 0xFFFFFFFF)."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", unknown) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + \
        b"data" + struct.pack("<I", unknown)


class _Sink:
    """Where the muxer writes: bytes kept until taken. No seek, so FFmpeg writes straight through."""

    def __init__(self) -> None:
        self._written = bytearray()

    def write(self, data: bytes) -> int:
        self._written += data
        return len(data)

    def take(self) -> bytes:
        taken = bytes(self._written)
        self._written.clear()
        return taken


class SpeechEncoder:
    def __init__(self, response_format: str, rate: int) -> None:
        if response_format not in FORMATS:
            raise ValueError(f"response_format {response_format!r}: not one of {', '.join(FORMATS)}")
        self.response_format, self.rate = response_format, rate
        self.compressed = response_format in COMPRESSED  # encoding costs CPU: callers keep it off the loop
        self._header = wav_header(rate) if response_format == "wav" else b""
        self._container = self._stream = None
        if self.compressed:
            muxer, encoder, _ = COMPRESSED[response_format]
            self._sink = _Sink()
            self._container = av.open(self._sink, mode="w", format=muxer, options={"flush_packets": "1", **MUXER_OPTIONS.get(muxer, {})})
            self._stream = self._container.add_stream(encoder, rate=rate, layout="mono")
        self._samples = 0  # the pts of the next frame, in samples
        # encode/finish run on a worker thread; close may come from the loop while one is in flight
        # (the request cancelled): never two at once on one FFmpeg context.
        self._lock = threading.Lock()

    def encode(self, pcm16: bytes) -> bytes:
        out, self._header = self._header, b""
        if not self.compressed:
            return out + pcm16
        with self._lock:
            if self._container is None:
                raise ValueError("the encoder is closed")
            samples = np.frombuffer(pcm16, dtype=np.int16).reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            frame.sample_rate, frame.pts = self.rate, self._samples
            self._samples += samples.shape[1]
            self._container.mux(self._stream.encode(frame))
            return out + self._sink.take()

    def finish(self) -> bytes:
        """The rest: what the encoder still held, and the container's trailer. Closes the encoder."""
        out, self._header = self._header, b""
        if not self.compressed:
            return out
        with self._lock:
            if self._container is None:
                raise ValueError("the encoder is closed")
            self._container.mux(self._stream.encode(None))
            self._container.close()
            self._container = None
            return out + self._sink.take()

    def close(self) -> None:
        """Drop an unfinished stream (the client left); waits for an encode in flight."""
        with self._lock:
            if self._container is not None:
                self._container.close()
                self._container = None
