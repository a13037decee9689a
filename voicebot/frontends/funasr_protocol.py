"""The FunASR runtime's 2-pass WebSocket protocol, as logic without sockets.

Existing FunASR clients (the runtime's C++/Java/Python/HTML5 clients, `funasr-client`) send a
JSON message {mode, chunk_size, wav_name, wav_format, audio_fs, is_speaking, hotwords, itn, ...},
then audio frames, then {"is_speaking": false}. We answer as the C++ 2-pass server
(runtime/websocket/bin/websocket-server-2pass.cpp) does, whose results are labelled `2pass-online`
and `2pass-offline` whatever the mode asked for (funasr-client's merge keeps only `2pass-offline`):

* mode "2pass": `2pass-online` deltas (the new text only) after each decode step, then one
  `2pass-offline` with the utterance's final text at each endpoint;
* mode "online": the same deltas, and at each endpoint a `2pass-offline` with the utterance's
  streamed text (the C++ server sends its accumulated online text there);
* mode "offline": one `2pass-offline` per utterance;
* `is_final` is true on exactly one message: the last, sent after the client's is_speaking=false
  (clients such as funasr-client stop reading at the first is_final=true); it also carries
  `is_end: true` when the client's message did (the runtime's Python client waits for that);
* extra fields: `confidence`, `asr_model`, `fallback` on final results.

Audio is raw s16le PCM (`wav_format` pcm, any case, as the C++ server takes it), or, with any
other `wav_format`, a whole file, decoded at is_speaking=false by what the bytes are, not by the
label (voicebot.audio.files.decode_file): the runtime's clients label every file that is not
.wav/.pcm "others", funasr-client and the HTML5 page send the extension. A file is taken in every
mode (the runtime's Python client sends "others" in its default 2pass mode); its audio then goes
through the segmenter and recognizer as a stream would, deltas included. A message we cannot
follow (not JSON, an unknown mode, a sample rate out of range, a file that cannot be decoded) ends
the stream as the C++ server ends one: with a final result whose `text` says what was wrong
(`error` holds the reason alone), after the results of the audio already received. Audio sent
after that is dropped until a new first message starts a new stream; the amount is counted and
reported at the client's next message. A client's end (is_speaking=false) with `is_end: true` is
always answered by exactly one final result that echoes it, an error result too, and after a
stream that had already ended with an error (the runtime's Python client waits for the echo, 300 s
by default, and reads `error` from it).

An engine that fails raises `EngineFailed`, named as voicebot_engine_failures_total names it on
/v1/voice (the segmenter: vad/chunk; the recognizer: asr/feed, asr/finish, its second pass and
dialect fallback included), so one engine's failures count under one label whichever route hit
them; the socket side ends the stream with it (voicebot/frontends/funasr_ws.py).

A VAD batcher with no room (`VadOverloaded`: the server is at capacity, nothing is broken) loses
the piece of audio it was given and the utterance that piece was part of, as on /v1/voice, and the
stream goes on: a live client keeps its connection through a moment of overload (the runtime's
clients never reconnect or restart a stream on their own). The client is told at once with a
non-final `2pass-offline` result with empty `text`, the lost utterance's end, carrying `error`,
`code: "busy"`, `retry_after_s` and `dropped_s`; its text stays empty because every FunASR client
concatenates `text` into its transcript (funasr-client merges `2pass-offline`, the runtime's
clients print it), and a C++-style `ERROR.` text is the end of a stream to them. Clients keep
fields they do not know (funasr-client returns the dict; the runtime's clients read only theirs).
What is lost is counted: voicebot_engine_overloads_total{engine="vad"} and
voicebot_input_dropped_seconds_total{reason="overload"} (the piece, what was heard of the
utterance, and the rest of it as it comes). What a failing engine loses is counted as
reason="engine_error": the piece the VAD or the streaming pass failed on, or the utterance whose
end the recognizer failed on.

No `timestamp` is sent: the streaming Paraformer has no per-character times, and clients that get
one zip it with the characters. `hotwords` and `itn` are accepted and ignored (the Paraformer
classes we serve have no hotword biasing and no ITN).

Endpoints come from a `Segmenter` (the server's VAD), the same one the /v1/voice sessions use.

Live audio is counted as a /v1/voice session's is: each message's input lag (from its arrival,
which the socket side stamps, to the end of its trip through the segmenter and the recognizer's
feed) goes to the server's `InputLag` under the pool of the stream's recognizer (so admission and
/readyz see a /funasr stream falling behind), and its seconds to voicebot_input_audio_seconds_total.
The recognizer stream is opened at the stream's first audio, so that pool is known from the start.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from voicebot.asr.base import SAMPLE_RATE, Hypothesis, Recognizer, RecognizerStream
from voicebot.audio.endpoint import EventKind, VadEvent
from voicebot.audio.files import UndecodableAudio, decode_file
from voicebot.audio.resample import StreamResampler, pcm16_to_float
from voicebot.frontends.funasr_config import ClientConfig, FunasrMessageError
from voicebot.metrics import Metrics
from voicebot.protocol import ErrorCode, ProtocolError, load_json
from voicebot.serving.lateness import InputLag
from voicebot.serving.vad import VAD_RETRY_AFTER_S, VadOverloaded

log = logging.getLogger(__name__)

ONLINE, OFFLINE = "2pass-online", "2pass-offline"  # the result labels, in every mode

# An uploaded file is held whole until is_speaking=false: 64 MiB is ~35 min of 16 kHz 16-bit wav,
# hours of mp3. Beyond it the stream ends with an error (the audio is counted as dropped). One
# message holds at most voicebot.protocol.MAX_MESSAGE_BYTES of it (the server's WebSocket limit);
# the flood guard does not count a file's bytes as PCM (funasr_ws.py), this bound holds them.
MAX_FILE_BYTES = 64 * 2**20
# A decoded file goes to the segmenter in pieces, as a live stream would arrive.
_FILE_PIECE = SAMPLE_RATE  # samples (1 s)


class EngineFailed(RuntimeError):
    """An engine failed on this stream: which one and at what stage (the labels of
    voicebot_engine_failures_total), and why (`__cause__`)."""

    def __init__(self, engine: str, stage: str, cause: Exception) -> None:
        super().__init__(f"{engine} ({stage}): {type(cause).__name__}: {cause}")
        self.engine, self.stage = engine, stage


class Segmenter(Protocol):
    async def process(self, audio: np.ndarray) -> list[VadEvent]: ...

    async def force_end(self) -> list[VadEvent]: ...


class FunasrSession:
    """One /funasr connection: client messages in, result messages out."""

    def __init__(self, recognizer: Recognizer, segmenter: Segmenter, metrics: Metrics, input_lag: InputLag | None = None) -> None:
        self.recognizer = recognizer
        self.segmenter = segmenter
        self.metrics = metrics
        self.input_lag = input_lag  # every live chunk's, as a /v1/voice session's (admission reads it)
        self.id = f"funasr-{uuid.uuid4().hex[:12]}"  # as InputLag tells sessions apart
        self.config = ClientConfig()
        self._resampler = StreamResampler(SAMPLE_RATE, SAMPLE_RATE)
        self._stream: RecognizerStream | None = None
        self._sent = ""  # partial text of the current utterance already sent
        self._in_utterance = False  # the segmenter has started an utterance and not ended it
        self._heard = 0  # samples of the current utterance given to the recognizer
        self._lost = False  # the current utterance was lost to an overload: the rest of it is dropped
        self._odd_byte = b""
        self._file = bytearray()  # a whole file (wav_format other than pcm), decoded at the end
        self._refused = False  # the stream ended with an error; audio is dropped until a new first message
        self._refusal = ""  # why it ended
        self.dropped_bytes = 0  # audio bytes received and not recognised, over the connection
        self._dropped_unreported = 0

    async def on_text(self, text: str) -> list[dict]:
        try:
            message = load_json(text)  # the input policy of every route: nothing echoed is unencodable
        except ProtocolError as exc:
            return await self.refuse(f"not JSON: {exc.message}" if exc.code == ErrorCode.INVALID_JSON else exc.message)
        if not isinstance(message, dict):
            return await self.refuse("a text message must be a JSON object")
        ending = not message.get("is_speaking", True)
        is_end = ending and bool(message.get("is_end"))
        if self._refused:
            if ending:  # the client's end of a stream that already ended with an error
                return [self._end_of_refused_stream(is_end)] if self._dropped_unreported or is_end else []
            self._refused = False  # a new first message: a new stream
        previous = (self.config.audio_fs, self.config.wav_format)
        try:
            self.config.update(message)
        except FunasrMessageError as exc:
            return await self.refuse(str(exc), is_end=is_end)
        if (self.config.audio_fs, self.config.wav_format) != previous:
            self._resampler = StreamResampler(self.config.audio_fs, SAMPLE_RATE)
        if not ending:
            return []
        return await self._end_of_input(is_end)

    @property
    def takes_file(self) -> bool:
        """The stream is receiving a whole file: its bytes are held (bounded by MAX_FILE_BYTES), not PCM."""
        return self.config.is_file and not self._refused

    async def on_audio(self, data: bytes, arrived: Sequence[float] = ()) -> list[dict]:
        """One or more consecutive binary messages' bytes; `arrived`: when each of those messages
        came off the socket. Each live (PCM) message's input lag, from then until its audio is
        through the segmenter and the recognizer's feed, is counted in `input_lag` under the pool
        of the stream's recognizer, as a /v1/voice session's chunks are (voicebot/serving/lateness.py)."""
        if self._refused:
            self._drop(len(data))
            return []
        if self.config.is_file:
            if len(self._file) + len(data) > MAX_FILE_BYTES:
                self._drop(len(data))
                return await self.refuse(f"the file is over {MAX_FILE_BYTES // 2**20} MiB")
            self._file += data
            return []
        pcm = self._odd_byte + data
        # A frame may split a sample; keep the odd byte for the next frame.
        self._odd_byte = pcm[len(pcm) & ~1 :]
        audio = self._resampler.process(pcm16_to_float(pcm[: len(pcm) & ~1]))
        try:
            self._open_stream()  # at the stream's first audio: its pool is what the input lag is counted by
        except Exception as exc:
            self._count_lost("engine_error", len(audio))
            raise EngineFailed("asr", "feed", exc) from exc
        return await self._hear(audio, arrived)

    def _open_stream(self) -> RecognizerStream:
        if self._stream is None:
            self._stream = self.recognizer.open()
        return self._stream

    def _count_live(self, samples: int, arrived: Sequence[float]) -> None:
        """Live audio through the segmenter and the recognizer's feed: counted as input, and the
        input lag of each message it came in observed."""
        self.metrics.input_audio.inc(samples / SAMPLE_RATE)
        if self.input_lag is not None:
            now = time.monotonic()
            self.input_lag.observe(getattr(self._stream, "pool", "asr"), self.id, [now - at for at in arrived])

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None

    async def _end_of_input(self, is_end: bool) -> list[dict]:
        if self.config.is_file:
            try:
                audio, _ = await asyncio.to_thread(decode_file, bytes(self._file))
            except UndecodableAudio as exc:
                return await self.refuse(f"the file (wav_format {self.config.wav_format!r}): {exc}", is_end=is_end)
            self._file.clear()
            messages = []
            for start in range(0, len(audio), _FILE_PIECE):
                messages += await self._hear(audio[start : start + _FILE_PIECE])
        else:
            messages = await self._hear(self._resampler.flush())
        self._resampler = StreamResampler(self.config.audio_fs, SAMPLE_RATE)
        messages += await self._events(await self._segmenter_call(self.segmenter.force_end))
        if not messages or messages[-1]["mode"] != OFFLINE or "error" in messages[-1]:  # an overload's notice is not the end
            messages.append(self._message(OFFLINE, ""))
        messages[-1]["is_final"] = True
        if is_end:  # the runtime's Python client (>= 1.4) waits for this acknowledgement
            messages[-1]["is_end"] = True
        return messages

    async def refuse(self, reason: str, is_end: bool = False) -> list[dict]:
        """End the stream: the results of the audio received so far, then the error as the final
        result (echoing `is_end` when it answers the client's end that carried it)."""
        messages = []
        if not self._refused:
            self._drop(len(self._file))
            self._file.clear()
            messages = await self._hear(self._resampler.flush())
            self._resampler = StreamResampler(self.config.audio_fs, SAMPLE_RATE)
            messages += await self._events(await self._segmenter_call(self.segmenter.force_end))
        self._refused = True
        self._refusal = reason
        return [*messages, self.error_result(reason, is_end)]

    def error_result(self, reason: str, is_end: bool = False) -> dict:
        """The final result that ends a stream with an error, as the FunASR runtime sends one."""
        result = self._message(OFFLINE, f"ERROR. {reason}") | {"error": reason, "is_final": True}
        return result | {"is_end": True} if is_end else result

    def _drop(self, n_bytes: int) -> None:
        self.dropped_bytes += n_bytes
        self._dropped_unreported += n_bytes

    def _end_of_refused_stream(self, is_end: bool) -> dict:
        """The answer to the client's end of a stream that had already ended with an error: that
        error again, with the audio dropped since, if any."""
        reason = f"the stream had ended with an error: {self._refusal}"
        if self._dropped_unreported:
            reason += (f"; {self._dropped_unreported} bytes of audio sent after it were not recognised; send a new "
                       f"first message to start a new stream")
        self._dropped_unreported = 0
        return self.error_result(reason, is_end)

    async def _hear(self, audio: np.ndarray, arrived: Sequence[float] = ()) -> list[dict]:
        """The results of a piece of 16 kHz audio: through the segmenter, then the recognizer.
        `arrived`: when the live messages it came in came off the socket (none for a file's
        audio or a flush)."""
        try:
            events = await self._segmenter_call(self.segmenter.process, audio)
        except VadOverloaded as exc:
            return await self._overloaded(len(audio), exc)
        except EngineFailed:
            self._count_lost("engine_error", len(audio))  # never judged; what came before is still finished
            raise
        messages = await self._events(events)
        if arrived:
            self._count_live(len(audio), arrived)
        return messages

    async def _segmenter_call(self, call, *args) -> list[VadEvent]:
        try:
            return await call(*args)
        except VadOverloaded:
            raise  # capacity, not a failure: _hear answers it
        except Exception as exc:
            raise EngineFailed("vad", "chunk", exc) from exc

    async def _overloaded(self, samples: int, exc: VadOverloaded) -> list[dict]:
        """The VAD had no room for this piece: it is lost, and so is the utterance it was part of
        (the module doc says what the client gets)."""
        dropped, and_utterance = samples, ""
        if self._in_utterance and not self._lost:
            dropped += self._heard
            self._lost = True
            await self._drop_stream()
            and_utterance = "; the utterance it was part of is lost"
        self.metrics.engine_overloads.labels("vad").inc()
        self._count_lost("overload", dropped)
        self.metrics.errors.labels(ErrorCode.BUSY).inc()
        reason = f"voice detection is at capacity ({exc}): {samples / SAMPLE_RATE:.2f} s of audio was dropped{and_utterance}"
        return [self._message(OFFLINE, "") | {"error": reason, "code": ErrorCode.BUSY, "retry_after_s": VAD_RETRY_AFTER_S,
                                              "overloaded": "vad", "engine": "vad", "stage": "chunk",
                                              "dropped_s": round(dropped / SAMPLE_RATE, 3)}]

    def _count_lost(self, reason: str, samples: int) -> None:
        self.metrics.input_dropped.labels(reason).inc(samples / SAMPLE_RATE)

    async def _drop_stream(self) -> None:
        """The recognizer's stream of a lost utterance closed: the next utterance opens a fresh one."""
        stream, self._stream, self._sent = self._stream, None, ""
        if stream is not None:
            try:
                await stream.close()
            except Exception:  # its state is dropped with it either way
                log.exception("/funasr: the recognizer stream of a lost utterance could not be closed")

    async def _events(self, events: list[VadEvent]) -> list[dict]:
        messages: list[dict] = []
        for event in events:
            if event.kind in (EventKind.START, EventKind.AUDIO) and len(event.audio):
                self._in_utterance = True
                if self._lost:  # the rest of an utterance lost to an overload
                    self._count_lost("overload", len(event.audio))
                    continue
                try:
                    partial = await self._open_stream().accept(event.audio)
                except Exception as exc:
                    self._count_lost("engine_error", len(event.audio))
                    raise EngineFailed("asr", "feed", exc) from exc
                self._heard += len(event.audio)
                if partial is not None and self.config.mode != "offline":
                    messages.append(self._partial(partial))
            elif event.kind is EventKind.END:
                was_lost, heard = self._lost, self._heard
                self._lost, self._in_utterance, self._heard = False, False, 0
                if self._stream is not None and not was_lost:  # a lost one's end was its overload's notice
                    try:
                        hypothesis = await self._stream.finish()
                    except Exception as exc:
                        self._count_lost("engine_error", heard)  # the utterance, with no transcript
                        raise EngineFailed("asr", "finish", exc) from exc
                    messages.extend(self._final(hypothesis))
                    self._sent = ""
        return messages

    def _partial(self, partial: str) -> dict:
        # Partials only grow within an utterance; clients expect the new text only.
        delta, self._sent = partial[len(self._sent) :], partial
        return self._message(ONLINE, delta)

    def _final(self, hypothesis: Hypothesis) -> list[dict]:
        messages = []
        if self.config.mode == "online":
            # Online clients concatenate deltas: send the tail the flush added, if any.
            tail = hypothesis.text[len(self._sent) :] if hypothesis.text.startswith(self._sent) else ""
            if tail:
                messages.append(self._message(ONLINE, tail))
        return [*messages, self._message(OFFLINE, hypothesis.text, hypothesis)]

    def _message(self, mode: str, text: str, hypothesis: Hypothesis | None = None) -> dict:
        message = {"mode": mode, "wav_name": self.config.wav_name, "text": text, "is_final": False}
        if hypothesis is not None:
            event = hypothesis.to_event()
            message |= {"confidence": event["confidence"], "asr_model": event["model"], "fallback": event["fallback"]}
        return message

