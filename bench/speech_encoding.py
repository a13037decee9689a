"""/v1/audio/speech's encoders (voicebot/audio/encode.py) and the upload decoder (voicebot/audio/files.py):
what they cost the event loop and what they hold back.

    python bench/speech_encoding.py

The speech route encodes each synthesized chunk as it arrives (compressed formats on a worker
thread, since these figures are too long for the event loop): per format, the time per 200 ms chunk
of 24 kHz speech (p50, p95, max over 30 s of espeak speech), its share of real time, and the bytes
sent per second of audio. Then decode_file's time and peak Python memory (tracemalloc: numpy's
buffers, not FFmpeg's own) for 60 s of speech in each input format, and for a WAV whose header
says 1 Hz (refused from its header). Figures from a shared box are upper bounds.
"""

from __future__ import annotations

import io
import struct
import time
import tracemalloc

import numpy as np

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)

from tests.audio import espeak_speech  # noqa: E402
from voicebot.audio.encode import FORMATS, SpeechEncoder  # noqa: E402
from voicebot.audio.files import UndecodableAudio, decode_file  # noqa: E402

RATE, CHUNK = 24000, 4800
TEXT = "please tell me a joke about the weather, and then what time the show starts tomorrow. " * 5


def speech(seconds: float, rate: int) -> np.ndarray:
    audio = espeak_speech(TEXT, rate=rate)
    return np.resize(audio, int(seconds * rate)).astype(np.float32)


def encoding() -> None:
    pcm = (speech(30, RATE) * 32767).astype("<i2").tobytes()
    print(f"{'format':7} {'p50 ms':>7} {'p95 ms':>7} {'max ms':>7} {'% of real time':>15} {'bytes out/s':>12}")
    for response_format in FORMATS:
        encoder, took, out = SpeechEncoder(response_format, RATE), [], 0
        for start in range(0, len(pcm), CHUNK * 2):
            began = time.perf_counter()
            out += len(encoder.encode(pcm[start : start + CHUNK * 2]))
            took.append(time.perf_counter() - began)
        out += len(encoder.finish())
        ms = np.array(took) * 1000
        print(f"{response_format:7} {np.percentile(ms, 50):7.2f} {np.percentile(ms, 95):7.2f} {ms.max():7.2f} "
              f"{100 * ms.sum() / 1000 / 30:15.2f} {out / 30:12.0f}")


def decoding() -> None:
    import av

    audio = speech(60, 48000)
    files = {}
    for name, muxer, codec in [("wav", "wav", "pcm_s16le"), ("flac", "flac", "flac"), ("mp3", "mp3", "libmp3lame"),
                               ("m4a", "ipod", "aac"), ("ogg/opus", "ogg", "libopus")]:
        buffer = io.BytesIO()
        with av.open(buffer, mode="w", format=muxer) as container:
            stream = container.add_stream(codec, rate=48000, layout="mono")
            frame = av.AudioFrame.from_ndarray((audio[None, :] * 32767).astype(np.int16), format="s16", layout="mono")
            frame.sample_rate = 48000
            container.mux(stream.encode(frame))
            container.mux(stream.encode(None))
        files[name] = buffer.getvalue()
    fmt = struct.pack("<HHIIHH", 1, 1, 1, 2, 2, 16)
    files["wav, header 1 Hz"] = (b"RIFF" + struct.pack("<I", 6036) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
                                 + b"data" + struct.pack("<I", 6000) + bytes(6000))
    print(f"\n{'60 s of 48 kHz speech as':26} {'file KB':>8} {'decode ms':>10} {'peak MB':>8}  result")
    for name, data in files.items():
        tracemalloc.start()
        began = time.perf_counter()
        try:
            decoded, duration = decode_file(data)
            result = f"{duration:.2f} s, {len(decoded)} samples at 16 kHz"
        except UndecodableAudio as exc:
            result = f"refused: {exc}"
        took = time.perf_counter() - began
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"{name:26} {len(data) / 1024:8.0f} {took * 1000:10.1f} {peak / 2**20:8.1f}  {result}")


if __name__ == "__main__":
    encoding()
    decoding()
