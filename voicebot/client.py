"""The reference client: the /v1/voice protocol as a program a plugin author can follow line by line.

    python -m voicebot.client --wav question.wav --out reply.wav [--url ws://127.0.0.1:8000/v1/voice]
    python -m voicebot.client --mic 10 --out reply.wav   # 10 s of microphone (optional `sounddevice`)

It streams audio in real time as s16le mono at the file's own rate (the server resamples), prints
every server event as one JSON line, and writes the reply audio (24 kHz s16le mono frames, joined)
to a wav file. What a client must do, in order:
  1. connect (with the token, if the server has one) and send `session.start` with the sample rate;
  2. wait for `session.ready`;
  3. send binary chunks of 20-100 ms, no faster than real time; `input.end` when the user stops
     (the server also finds the end of speech by itself);
  4. read text frames as JSON events and binary frames as reply audio; on `audio.interrupted`
     drop any reply audio not yet played.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import wave
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import numpy as np
import websockets

CHUNK_MS = 100
# Largest reply kept in memory: 10 minutes of 24 kHz s16le (29 MB); past it, frames are not kept.
MAX_REPLY_BYTES = 10 * 60 * 24000 * 2
# Events kept in Result.events (older ones were still passed to on_event).
MAX_EVENTS = 10_000


@dataclass
class Result:
    session_id: str = ""
    output_sample_rate: int = 24000
    events: deque[dict] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    reply_audio: bytearray = field(default_factory=bytearray)


def read_wav(path: Path) -> tuple[bytes, int]:
    """A wav file as s16le mono PCM and its rate (channels averaged)."""
    import soundfile

    audio, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    return (np.clip(mono, -1, 1) * 32767).astype("<i2").tobytes(), rate


async def wav_chunks(pcm: bytes, rate: int) -> AsyncIterator[bytes]:
    """Chunks of CHUNK_MS, each sent when a live microphone would have produced it."""
    step = rate * CHUNK_MS // 1000 * 2
    start = time.monotonic()
    for i, offset in enumerate(range(0, len(pcm), step)):
        await asyncio.sleep(max(0.0, start + i * CHUNK_MS / 1000 - time.monotonic()))
        yield pcm[offset : offset + step]


async def mic_chunks(rate: int, seconds: float) -> AsyncIterator[bytes]:
    """The default microphone for `seconds` (optional dependency: sounddevice)."""
    try:
        import sounddevice
    except ImportError:
        raise SystemExit("--mic needs the sounddevice package: pip install sounddevice") from None
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes] = asyncio.Queue(50)  # 5 s of 100 ms chunks; past that, audio is dropped

    def offer(chunk: bytes) -> None:
        if not chunks.full():
            chunks.put_nowait(chunk)

    def on_audio(data, _frames, _time, _status) -> None:  # on PortAudio's thread
        loop.call_soon_threadsafe(offer, bytes(data))

    with sounddevice.RawInputStream(samplerate=rate, channels=1, dtype="int16", blocksize=rate * CHUNK_MS // 1000, callback=on_audio):
        for _ in range(int(seconds * 1000 / CHUNK_MS)):
            yield await chunks.get()


async def converse(
    url: str,
    audio: AsyncIterator[bytes],
    sample_rate: int,
    *,
    token: str | None = None,
    channel: str | None = None,
    voice: str | None = None,
    say: str | None = None,
    linger_s: float = 2.0,
    on_event: Callable[[dict], None] = lambda event: None,
) -> Result:
    """Stream `audio`, then wait until the server has been quiet for `linger_s` with no reply playing."""
    result = Result()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with websockets.connect(url, additional_headers=headers, max_size=2**20) as ws:
        start = {"type": "session.start", "sample_rate": sample_rate}
        start.update({k: v for k, v in (("channel", channel), ("voice", voice)) if v})
        await ws.send(json.dumps(start))
        ready = json.loads(await ws.recv())
        on_event(ready)
        result.events.append(ready)
        if ready["type"] != "session.ready":
            raise RuntimeError(f"session refused: {ready}")
        result.session_id = ready["session_id"]
        result.output_sample_rate = ready["output_sample_rate"]

        async def send() -> None:
            if say:
                await ws.send(json.dumps({"type": "say", "text": say}))
            async for chunk in audio:
                await ws.send(chunk)
            await ws.send(json.dumps({"type": "input.end"}))

        sender = asyncio.create_task(send())
        speaking = False  # between audio.start and audio.end / audio.interrupted
        while True:
            try:
                message = await asyncio.wait_for(ws.recv(), timeout=linger_s)
            except asyncio.TimeoutError:
                if sender.done() and not speaking:
                    break
                continue
            if isinstance(message, bytes):
                if len(result.reply_audio) + len(message) <= MAX_REPLY_BYTES:
                    result.reply_audio += message
                continue
            event = json.loads(message)
            on_event(event)
            result.events.append(event)
            if event["type"] == "audio.start":
                speaking = True
            elif event["type"] in ("audio.end", "audio.interrupted"):
                speaking = False
        await sender  # re-raises a failure to send
    return result


def write_wav(path: Path, pcm: bytes, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Talk to a voicebot server: stream a wav file or the microphone, save the reply.")
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/voice")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--wav", type=Path, help="audio file to stream in real time (any rate, any channels)")
    source.add_argument("--mic", type=float, metavar="SECONDS", help="stream the default microphone for this long")
    parser.add_argument("--out", type=Path, default=Path("reply.wav"), help="where to write the reply audio")
    parser.add_argument("--token", help="the server's shared token, if it has one")
    parser.add_argument("--channel", help="speak on this channel (overlays listening to it follow)")
    parser.add_argument("--voice")
    parser.add_argument("--say", help="also ask the bot to say this text")
    parser.add_argument("--linger", type=float, default=2.0, help="seconds of server silence that end the conversation")
    args = parser.parse_args(argv)

    def print_event(event: dict) -> None:
        print(json.dumps(event, ensure_ascii=False), flush=True)

    if args.wav:
        pcm, rate = read_wav(args.wav)
        audio = wav_chunks(pcm, rate)
    else:
        rate = 16000
        audio = mic_chunks(rate, args.mic)
    try:
        result = asyncio.run(
            converse(args.url, audio, rate, token=args.token, channel=args.channel, voice=args.voice, say=args.say,
                     linger_s=args.linger, on_event=print_event)
        )
    except (OSError, RuntimeError, websockets.WebSocketException) as exc:
        print(f"voicebot.client: {exc}", file=sys.stderr)
        return 1
    write_wav(args.out, bytes(result.reply_audio), result.output_sample_rate)
    seconds = len(result.reply_audio) / 2 / result.output_sample_rate
    print(f"wrote {seconds:.2f} s of reply audio to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
