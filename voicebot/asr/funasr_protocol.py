"""The FunASR runtime's 2-pass WebSocket protocol, as logic without sockets.

Existing FunASR clients (the runtime's C++/Java/Python/HTML5 clients, `funasr-client`) send a
JSON message {mode, chunk_size, wav_name, wav_format, audio_fs, is_speaking, hotwords, itn, ...},
then raw s16le PCM frames, then {"is_speaking": false}. We answer as the C++ 2-pass server does:

* mode "online": {"mode": "online", "text": <new text only>} after each decode step;
* mode "offline": {"mode": "offline", "text": <utterance>} at each endpoint;
* mode "2pass": "2pass-online" deltas, then "2pass-offline" with the final (second-pass) text;
* `is_final` is true on exactly one message: the last, sent after the client's is_speaking=false
  (clients such as funasr-client stop reading at the first is_final=true); it also carries
  `is_end: true` when the client's message did (the runtime's Python client waits for that);
* extra fields: `confidence`, `asr_model`, `fallback` on final results.

No `timestamp` is sent: the streaming Paraformer has no per-character times, and clients that get
one zip it with the characters. `hotwords` and `itn` are accepted and ignored (the Paraformer
classes we serve have no hotword biasing and no ITN).

Endpoints come from a `Segmenter` (the server's VAD), the same one the /v1/voice sessions use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from voicebot.asr.base import SAMPLE_RATE, Hypothesis, Recognizer, RecognizerStream
from voicebot.audio.endpoint import EventKind, VadEvent
from voicebot.audio.resample import StreamResampler, pcm16_to_float

Mode = Literal["online", "offline", "2pass"]
_MODES = ("online", "offline", "2pass")


class ProtocolError(ValueError):
    """A client message we cannot use; the handler reports it and keeps the connection."""


class Segmenter(Protocol):
    async def process(self, audio: np.ndarray) -> list[VadEvent]: ...

    async def force_end(self) -> list[VadEvent]: ...


@dataclass
class ClientConfig:
    mode: Mode = "2pass"
    wav_name: str = "stream"
    wav_format: str = "pcm"
    audio_fs: int = SAMPLE_RATE

    def update(self, message: dict) -> None:
        mode = message.get("mode", self.mode)
        if mode not in _MODES:
            raise ProtocolError(f"mode must be one of {', '.join(_MODES)}, not {mode!r}")
        audio_fs = message.get("audio_fs", self.audio_fs)
        if not isinstance(audio_fs, int) or not 8000 <= audio_fs <= 48000:
            raise ProtocolError(f"audio_fs must be an integer sample rate in 8000-48000, not {audio_fs!r}")
        wav_format = message.get("wav_format") or self.wav_format
        if wav_format != "pcm":
            raise ProtocolError(f"only wav_format 'pcm' is supported for streams, not {wav_format!r}")
        self.mode, self.audio_fs, self.wav_format = mode, audio_fs, wav_format
        self.wav_name = str(message.get("wav_name", self.wav_name))


class FunasrSession:
    """One /funasr connection: client messages in, result messages out."""

    def __init__(self, recognizer: Recognizer, segmenter: Segmenter) -> None:
        self.recognizer = recognizer
        self.segmenter = segmenter
        self.config = ClientConfig()
        self._resampler = StreamResampler(SAMPLE_RATE, SAMPLE_RATE)
        self._stream: RecognizerStream | None = None
        self._sent = ""  # partial text of the current utterance already sent
        self._odd_byte = b""

    async def on_text(self, text: str) -> list[dict]:
        try:
            message = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProtocolError(f"not JSON: {exc}") from exc
        if not isinstance(message, dict):
            raise ProtocolError("a text message must be a JSON object")
        previous_fs = self.config.audio_fs
        self.config.update(message)
        if self.config.audio_fs != previous_fs:
            self._resampler = StreamResampler(self.config.audio_fs, SAMPLE_RATE)
        if message.get("is_speaking", True):
            return []
        return await self._end_of_input(bool(message.get("is_end")))

    async def on_audio(self, data: bytes) -> list[dict]:
        data = self._odd_byte + data
        # A frame may split a sample; keep the odd byte for the next frame.
        self._odd_byte = data[len(data) & ~1 :]
        audio = self._resampler.process(pcm16_to_float(data[: len(data) & ~1]))
        return await self._events(await self.segmenter.process(audio))

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None

    async def _end_of_input(self, is_end: bool) -> list[dict]:
        events = await self.segmenter.process(self._resampler.flush())
        self._resampler = StreamResampler(self.config.audio_fs, SAMPLE_RATE)
        events += await self.segmenter.force_end()
        messages = await self._events(events)
        final_mode = {"online": "online", "offline": "offline", "2pass": "2pass-offline"}[self.config.mode]
        if not messages or messages[-1]["mode"] != final_mode:
            messages.append(self._message(final_mode, ""))
        messages[-1]["is_final"] = True
        if is_end:  # the runtime's Python client (>= 1.4) waits for this acknowledgement
            messages[-1]["is_end"] = True
        return messages

    async def _events(self, events: list[VadEvent]) -> list[dict]:
        messages: list[dict] = []
        for event in events:
            if event.kind in (EventKind.START, EventKind.AUDIO) and len(event.audio):
                if self._stream is None:
                    self._stream = self.recognizer.open()
                partial = await self._stream.accept(event.audio)
                if partial is not None and self.config.mode != "offline":
                    messages.append(self._partial(partial))
            elif event.kind is EventKind.END and self._stream is not None:
                messages.extend(self._final(await self._stream.finish()))
                self._sent = ""
        return messages

    def _partial(self, partial: str) -> dict:
        # Partials only grow within an utterance; clients expect the new text only.
        delta, self._sent = partial[len(self._sent) :], partial
        return self._message("online" if self.config.mode == "online" else "2pass-online", delta)

    def _final(self, hypothesis: Hypothesis) -> list[dict]:
        if self.config.mode == "online":
            # Online clients concatenate deltas: send the tail the flush added, if any.
            tail = hypothesis.text[len(self._sent) :] if hypothesis.text.startswith(self._sent) else ""
            return [self._message("online", tail, hypothesis)] if tail else []
        mode = "offline" if self.config.mode == "offline" else "2pass-offline"
        return [self._message(mode, hypothesis.text, hypothesis)]

    def _message(self, mode: str, text: str, hypothesis: Hypothesis | None = None) -> dict:
        message = {"mode": mode, "wav_name": self.config.wav_name, "text": text, "is_final": False}
        if hypothesis is not None:
            event = hypothesis.to_event()
            message |= {"confidence": event["confidence"], "asr_model": event["model"], "fallback": event["fallback"]}
        return message
