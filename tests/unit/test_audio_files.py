"""decode_file: FFmpeg decodes what it recognizes whatever the label, and a file's header is
checked before any work; its decoded length is bounded even where the header lies."""

from __future__ import annotations

import io
import struct
import wave

import av
import numpy as np
import pytest

from voicebot.audio.files import MAX_CHANNELS, AudioTooLong, UndecodableAudio, decode_file


def tone(rate: int, seconds: float, channels: int = 1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return np.repeat((0.5 * np.sin(2 * np.pi * 440 * t))[None, :], channels, axis=0).astype(np.float32)


def wav_bytes(audio: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(audio.shape[0]), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((audio.T * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def encoded(audio: np.ndarray, rate: int, muxer: str, codec: str) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=muxer) as container:
        stream = container.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray((audio[:1] * 32767).astype(np.int16), format="s16", layout="mono")
        frame.sample_rate = rate
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def test_a_stereo_44k_wav_becomes_16k_mono_of_the_same_length():
    audio, duration = decode_file(wav_bytes(tone(44100, 1.5, channels=2), 44100))
    assert duration == pytest.approx(1.5) and audio.dtype == np.float32
    assert len(audio) == pytest.approx(1.5 * 16000, abs=16) and 0.3 < np.abs(audio).max() < 0.6


@pytest.mark.parametrize("muxer, codec", [("mp3", "libmp3lame"), ("ipod", "aac"), ("webm", "libopus"),
                                          ("ogg", "libopus"), ("flac", "flac")])
def test_compressed_formats_decode_by_their_content(muxer, codec):
    rate = 48000 if codec == "libopus" else 16000
    audio, duration = decode_file(encoded(tone(rate, 2.0), rate, muxer, codec))
    # within the codec's priming and padding (AAC: a 1024-sample frame and the last one's rest)
    assert duration == pytest.approx(2.0, abs=0.15) and np.sqrt(np.mean(audio**2)) > 0.2


def _wav_header(rate: int, channels: int, data_bytes: int) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
    return (b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", data_bytes))


@pytest.mark.parametrize("header, says", [
    (_wav_header(1, 1, 6000), "sample rate is 1 Hz"),  # 6 KB that were 50 min of 16 kHz audio, resampled first
    (_wav_header(4000, 1, 6000), "sample rate is 4000 Hz"),
    (_wav_header(16000, MAX_CHANNELS + 1, 6000), f"{MAX_CHANNELS + 1} channels"),
])
def test_a_header_out_of_bounds_is_refused(header, says):
    with pytest.raises(UndecodableAudio, match=says):
        decode_file(header + b"\1\0" * 3000)


def test_a_declared_duration_over_the_limit_is_refused_before_decoding():
    two_minutes = wav_bytes(tone(16000, 120.0), 16000)
    with pytest.raises(AudioTooLong, match="120 s long; the limit is 60 s"):
        decode_file(two_minutes, max_duration_s=60)


def test_a_header_that_says_less_than_it_has_is_stopped_while_decoding():
    # An Ogg stream says nothing of its length up front (FFmpeg reads it from the last page, if it can).
    # The limit holds on the samples decoded, whatever the header said.
    ogg = encoded(tone(48000, 5.0), 48000, "ogg", "libopus")
    with pytest.raises(AudioTooLong):
        decode_file(ogg, max_duration_s=2)
    assert decode_file(ogg, max_duration_s=6)[1] == pytest.approx(5.0, abs=0.1)


@pytest.mark.parametrize("data", [
    b"not audio at all" * 100,
    b"",
    b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n",  # a playlist: never opened
    b"ffconcat version 1.0\nfile '/etc/passwd'\n",
])
def test_what_is_not_an_audio_file_is_refused_and_nothing_it_names_is_opened(data):
    with pytest.raises(UndecodableAudio) as refused:
        decode_file(data)
    assert "object at 0x" not in str(refused.value)
