"""OpenAI-compatible speech and transcription endpoints, on the runtime's own engines.

`POST /v1/audio/speech` speaks `input` with the configured synthesizer and streams the audio as it
is synthesized, encoded as it comes (voicebot/audio/encode.py): `response_format` mp3 (the default,
as OpenAI's), opus (Ogg), aac (ADTS), flac, wav (a header whose sizes say "unknown length", then
the samples) or pcm (24 kHz s16le mono, as OpenAI's); `stream_format` audio (the bytes) or sse (the
same bytes, base64 in `speech.audio.delta` events, then `speech.audio.done`). `voice` is any
configured voice; `model` is accepted and not used (the server has one synthesizer). `speed` other
than 1 and `instructions` are refused: no engine here takes them per request. The body is read up
to MAX_SPEECH_BODY_BYTES and no further (413 past it).

`POST /v1/audio/transcriptions` reads the multipart body as it streams, up to MAX_UPLOAD_BYTES
(413 as soon as it passes it, nothing more written to disk), decodes the file with FFmpeg whatever
its format (voicebot/audio/files.py: its header's rate, channels and duration checked before any
decoding, MAX_TRANSCRIPTION_S at most), cuts it into utterances with the Silero endpointer (the
server's `endpoint` settings), and recognizes each with the configured recognizer:
`response_format` json, text, srt, vtt or verbose_json, whose segments carry the recognizer's own
`confidence` (geometric mean of token posteriors, null where the engine has none; `avg_logprob` is
its log) and `model`.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and status; a request
gives its place back however it ends (an error, a body that cannot be parsed, a client that hangs
up mid-body, a bug: a 500 in the same shape). With
`server.token` set the token is required, as the API key (`Authorization: Bearer`). A request
takes a place in `server.max_sessions` while it runs (a speech stream until its last byte): at the
limit it gets 503 `busy` with Retry-After. It is also a session of its client address
(`server.max_sessions_per_client`, voicebot/limits.py), so one address cannot hold every place
with requests: past that limit it gets 429 `rate_limit_exceeded` with Retry-After.
voicebot_audio_api_requests_total{route, outcome} counts requests (outcome `ok` or the error code),
voicebot_audio_api_audio_seconds_total{route} the audio synthesized or uploaded.
Model work stays off the event loop: the engines run on their own workers, and the endpointer and
the file decoder run in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from voicebot import auth
from voicebot.asr.base import Hypothesis
from voicebot.audio import encode
from voicebot.audio.endpoint import WINDOW, Endpointer, EventKind
from voicebot.audio.files import SAMPLE_RATE as ASR_RATE
from voicebot.audio.files import AudioTooLong, UndecodableAudio, decode_file
from voicebot.audio.resample import float_to_pcm16
from voicebot.limits import ClientLimits
from voicebot.tts.base import SAMPLE_RATE as TTS_RATE

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/audio")

MAX_INPUT_CHARS = 4096  # OpenAI's limit for `input`
# A speech request's whole JSON body: 4096 characters of input, each at most 12 bytes as a JSON
# escape (a surrogate pair), are 48 KiB; the rest of the fields are small.
MAX_SPEECH_BODY_BYTES = 2**16 * 2
MAX_UPLOAD_BYTES = 25 * 2**20  # OpenAI's limit for a transcription upload
MAX_FORM_OVERHEAD_BYTES = 2**16  # the form's other fields and part headers, on top of the file
MAX_TRANSCRIPTION_S = 3600.0  # an hour: 230 MB as 16 kHz float32, what one request may hold
TRANSCRIPTION_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return JSONResponse(body, status_code=self.status, headers=headers)

    @property
    def outcome(self) -> str:
        """The label of this failure in voicebot_audio_api_requests_total."""
        return self.code or str(self.status)


class AudioRequests:
    """The /v1/audio/* requests running now; the app counts them toward server.max_sessions."""

    def __init__(self) -> None:
        self.running = 0


class _Place:
    """One request's place in server.max_sessions and among its address's sessions, from
    admission to its last byte."""

    def __init__(self, requests: AudioRequests, client_limits: ClientLimits, request: Request, metrics, route: str) -> None:
        self._requests, self._client_limits, self._metrics, self.route = requests, client_limits, metrics, route
        self._held = True
        requests.running += 1
        self._address = client_limits.take_session(request.scope)
        metrics.audio_api_active.inc()

    def release(self, outcome: str) -> None:
        """Give the place back (once) and count the request's outcome: `ok` or an error code."""
        if self._held:
            self._held = False
            self._requests.running -= 1
            self._client_limits.release_session(self._address)
            self._metrics.audio_api_active.dec()
            self._metrics.audio_api_requests.labels(self.route, outcome).inc()


def _admit(request: Request, route: str):
    """The runtime and the request's place, or an ApiError (counted) if it cannot be served now."""
    rt, client_limits = request.app.state.runtime, request.app.state.client_limits
    token = rt.settings.server.token
    try:
        if token is not None and not auth.token_matches(auth.presented_token(request), token):
            raise ApiError(401, "missing or wrong API key (the server's token)", code="invalid_api_key")
        if rt.draining or not rt.ready:
            raise ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error")
        # This address's own share first, as for WebSockets: it is the reason a retry would meet again.
        if too_many := client_limits.refusal(request.scope, session=True):
            raise ApiError(429, too_many, code="rate_limit_exceeded", kind="rate_limit_error", retry_after_s=5)
        if request.app.state.occupied() >= rt.settings.server.max_sessions:
            raise ApiError(503, f"the server is at its limit of {rt.settings.server.max_sessions} sessions",
                           code="busy", kind="server_error", retry_after_s=5)
    except ApiError as exc:
        rt.metrics.audio_api_requests.labels(route, exc.outcome).inc()
        raise
    return rt, _Place(request.app.state.audio_requests, client_limits, request, rt.metrics, route)


# --- speech


@dataclass(frozen=True)
class SpeechRequest:
    input: str
    voice: str
    response_format: str
    stream_format: str

    @classmethod
    def parse(cls, body: Any) -> "SpeechRequest":
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise ApiError(400, "model is required (any name: the server has one synthesizer)", "model")
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "input must be a non-empty string", "input")
        if not _is_unicode(text):
            raise ApiError(400, "input has a lone surrogate (a \\ud800-\\udfff escape not in a pair): it is not text",
                           "input", "invalid_value")
        if len(text) > MAX_INPUT_CHARS:
            raise ApiError(400, f"input is {len(text)} characters; the limit is {MAX_INPUT_CHARS}", "input",
                           "string_above_max_length")
        voice = body.get("voice")
        voice = voice.get("id") if isinstance(voice, dict) else voice  # {"id": ...}: a custom voice
        if not isinstance(voice, str) or not voice or not _is_unicode(voice):
            raise ApiError(400, "voice is required, as text", "voice")
        response_format = body.get("response_format", "mp3")
        if response_format not in encode.FORMATS:
            raise ApiError(400, f"response_format {str(response_format)[:40]!r} is not supported here; use one of "
                                f"{', '.join(encode.FORMATS)}", "response_format")
        stream_format = body.get("stream_format", "audio")
        if stream_format not in ("audio", "sse"):
            raise ApiError(400, f"stream_format must be audio or sse, not {str(stream_format)[:40]!r}", "stream_format")
        speed = body.get("speed", 1.0)
        if not isinstance(speed, (int, float)) or isinstance(speed, bool) or not 0.25 <= speed <= 4.0:
            raise ApiError(400, f"speed must be a number in 0.25-4.0, not {str(speed)[:40]!r}", "speed")
        if speed != 1.0:
            raise ApiError(400, "speed is not supported: the server's synthesizers stream at their own rate",
                           "speed", "unsupported_value")
        if body.get("instructions"):
            raise ApiError(400, "instructions are not supported by the server's synthesizers", "instructions",
                           "unsupported_value")
        return cls(text, voice, response_format, stream_format)


def _is_unicode(text: str) -> bool:
    """False for a str holding a lone surrogate (JSON's "\\ud800" parses to one), which no
    encoder, engine or log line can take."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


async def _one(text: str) -> AsyncIterator[str]:
    yield text


async def _body(request: Request, limit: int) -> bytes:
    """The request body, read only up to `limit` bytes: past it, 413 at once, whatever
    Content-Length said (or did not say, chunked)."""
    declared = request.headers.get("content-length", "")
    too_large = ApiError(413, f"the request body is over this route's limit of {limit} bytes", code="body_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}") from None
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not JSON: not UTF-8") from None
    except (ValueError, RecursionError):  # a number past Python's 4300 digits; arrays nested thousands deep
        raise ApiError(400, "the request body is JSON this server does not take: nested too deeply or a number "
                            "too long") from None


@contextlib.contextmanager
def _refusing(place: _Place):
    """Around a request's work before its response: whatever ends it early gives its place back.
    An ApiError is answered as itself; a client that hung up gets nothing (there is nobody to
    read it); anything else is a bug, logged, answered 500 in OpenAI's shape."""
    try:
        yield
    except ApiError as exc:
        place.release(exc.outcome)
        raise
    except ClientDisconnect:
        place.release("client_gone")
        raise
    except Exception as exc:
        place.release("internal_error")
        log.exception("%s failed", place.route)
        raise ApiError(500, f"the server failed: {type(exc).__name__}", kind="server_error", code="internal_error") from exc
    except BaseException:  # cancelled: the server is stopping
        place.release("client_gone")
        raise


def _answer(exc: ApiError | ClientDisconnect) -> Response:
    return exc.response() if isinstance(exc, ApiError) else Response(status_code=400)


@router.post("/speech", response_model=None)
async def speech(request: Request) -> Response:
    try:
        rt, place = _admit(request, "speech")
    except ApiError as exc:
        return exc.response()
    try:
        with _refusing(place):
            req = SpeechRequest.parse(_json(await _body(request, MAX_SPEECH_BODY_BYTES)))
            try:
                context = rt.synthesizer.open(req.voice)
            except KeyError:
                names = ", ".join(v.name for v in rt.synthesizer.voices())
                raise ApiError(400, f"voice {req.voice[:100]!r} is not configured; have {names}", "voice") from None
            audio = _pcm(context, req.input, rt.metrics)
            try:
                # The first chunk before the status line: an engine that fails at once gets a 500, not a
                # 200 with an empty body.
                first = await anext(audio, b"")
            except Exception as exc:  # the generator has closed the context on its way out
                log.exception("speech synthesis failed")
                raise ApiError(500, f"synthesis failed: {exc}", kind="server_error", code="synthesis_failed") from exc
            try:
                encoder = encode.SpeechEncoder(req.response_format, TTS_RATE)
            except BaseException:
                await audio.aclose()
                raise
    except (ApiError, ClientDisconnect) as exc:
        return _answer(exc)
    # The place is released as the stream ends; the background task only covers a stream that never
    # began (the client gone before its first byte), and does nothing otherwise.
    never_began = BackgroundTask(place.release, "client_gone")
    if req.stream_format == "sse":
        return StreamingResponse(_sse(first, audio, encoder, place), media_type="text/event-stream", background=never_began)
    return StreamingResponse(_bytes(first, audio, encoder, place), media_type=encode.media_type(req.response_format),
                             background=never_began)


async def _pcm(context, text: str, metrics) -> AsyncIterator[bytes]:
    """The synthesizer's chunks as s16le bytes; closes the context when done or cut off."""
    samples = 0
    try:
        async with contextlib.aclosing(context.stream(_one(text))) as chunks:
            async for chunk in chunks:
                samples += len(chunk.audio)
                yield float_to_pcm16(chunk.audio)
    finally:
        await context.close()
        metrics.audio_api_seconds.labels("speech").inc(samples / TTS_RATE)
        log.debug("speech: %.2f s synthesized", samples / TTS_RATE)


@contextlib.asynccontextmanager
async def _streaming(rest: AsyncIterator[bytes], encoder: encode.SpeechEncoder, place: _Place):
    """While a response streams: its place is held; at the end it is released with the outcome
    (`client_gone` if the client left first, `synthesis_failed` if the engine failed mid-stream)."""
    outcome = "client_gone"
    try:
        async with contextlib.aclosing(rest):
            yield
        outcome = "ok"
    except Exception:
        outcome = "synthesis_failed"
        raise
    finally:
        encoder.close()
        place.release(outcome)


async def _encoded(first: bytes, rest: AsyncIterator[bytes], encoder: encode.SpeechEncoder) -> AsyncIterator[bytes]:
    """The response format's bytes as each chunk is synthesized (none where the encoder holds them yet).

    A compressed format is encoded on a thread: LAME and FFmpeg's AAC took 17 and 31 ms (p50; up to
    190 ms) per 200 ms chunk on a loaded 2-core box (bench/speech_encoding.py), too long for the loop.
    """

    async def encoded(pcm: bytes) -> bytes:
        return await asyncio.to_thread(encoder.encode, pcm) if encoder.compressed else encoder.encode(pcm)

    if data := await encoded(first):
        yield data
    async for pcm in rest:
        if data := await encoded(pcm):
            yield data
    if data := (await asyncio.to_thread(encoder.finish) if encoder.compressed else encoder.finish()):
        yield data


async def _bytes(first: bytes, rest: AsyncIterator[bytes], encoder: encode.SpeechEncoder, place: _Place) -> AsyncIterator[bytes]:
    async with _streaming(rest, encoder, place):
        async for data in _encoded(first, rest, encoder):
            yield data


async def _sse(first: bytes, rest: AsyncIterator[bytes], encoder: encode.SpeechEncoder, place: _Place) -> AsyncIterator[bytes]:
    """The same bytes as the audio stream, base64 in `speech.audio.delta` events."""

    def event(body: dict) -> bytes:
        return f"data: {json.dumps(body)}\n\n".encode()

    async with _streaming(rest, encoder, place):
        async for data in _encoded(first, rest, encoder):
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        yield event({"type": "speech.audio.done"})


# --- transcription


@dataclass(frozen=True)
class Segment:
    start: float  # seconds
    end: float
    hypothesis: Hypothesis


def _utterances(endpointer: Endpointer, audio: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """(first sample, end of the last speech window, audio) of each utterance the endpointer finds.

    Blocking. One window per call, so every event's position in the file is known exactly; the
    last partial window (under 32 ms) is not judged.
    """
    found, start, pieces = [], 0, []
    for offset in range(0, len(audio) - WINDOW + 1, WINDOW):
        for event in endpointer.process(audio[offset : offset + WINDOW]):
            if event.kind is EventKind.START:
                start, pieces = endpointer.samples_seen - len(event.audio), [event.audio]
            elif event.kind is EventKind.AUDIO:
                pieces.append(event.audio)
            else:
                found.append((start, event.speech_end_sample, np.concatenate(pieces)))
    for event in endpointer.force_end():  # the file ended inside an utterance
        found.append((start, event.speech_end_sample, np.concatenate(pieces)))
    return found


class _FormTooLarge(MultiPartException):
    """Raised into the multipart parser as a MultiPartException, so that it closes its files."""


async def _bounded(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks as they come, stopped as soon as they pass `limit` bytes."""
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise _FormTooLarge(f"over {limit} bytes")
        yield chunk


async def _form(request: Request):
    """The file's bytes and the form. The multipart parser reads the body as it streams (the file
    spooled to a temporary file past 1 MiB): a body over the limit, declared or chunked, is
    refused as soon as it passes it."""
    limit = MAX_UPLOAD_BYTES + MAX_FORM_OVERHEAD_BYTES
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the file is over the {MAX_UPLOAD_BYTES // 2**20} MiB limit", "file", "file_too_large")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "expected a multipart/form-data body with a file")
    parser = MultiPartParser(request.headers, _bounded(request, limit), max_files=1, max_fields=20)
    try:
        form = await parser.parse()
    except _FormTooLarge:
        raise ApiError(413, f"the file is over the {MAX_UPLOAD_BYTES // 2**20} MiB limit", "file", "file_too_large") from None
    except MultiPartException as exc:
        raise ApiError(400, f"expected a multipart/form-data body with a file: {exc.message}") from None
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError(400, "file is required (an audio file in a multipart form)", "file")
        data = await upload.read(MAX_UPLOAD_BYTES + 1)
        if len(data) > MAX_UPLOAD_BYTES:
            raise ApiError(413, f"the file is over the {MAX_UPLOAD_BYTES // 2**20} MiB limit", "file", "file_too_large")
    finally:
        await form.close()
    return data, form


def _field(form, name: str, default: str) -> str:
    value = form.get(name, default)
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a form field, not a file", name)
    return value


@router.post("/transcriptions", response_model=None)
async def transcriptions(request: Request) -> Response:
    try:
        rt, place = _admit(request, "transcriptions")
    except ApiError as exc:
        return exc.response()
    try:
        with _refusing(place):
            data, fields = await _form(request)
            if not _field(fields, "model", ""):
                raise ApiError(400, "model is required (any name: the server has one recognizer)", "model")
            response_format = _field(fields, "response_format", "json")
            if response_format not in TRANSCRIPTION_FORMATS:
                raise ApiError(400, f"response_format {response_format[:40]!r} is not supported here; use one of "
                                    f"{', '.join(TRANSCRIPTION_FORMATS)}", "response_format")
            if _field(fields, "stream", "false").lower() == "true":
                raise ApiError(400, "streamed transcription is not supported here; use /v1/realtime", "stream")
            granularities = fields.getlist("timestamp_granularities[]") + fields.getlist("timestamp_granularities")
            if any(g != "segment" for g in granularities):
                raise ApiError(400, "only segment timestamps are available", "timestamp_granularities")
            try:
                audio, duration = await asyncio.to_thread(decode_file, data, MAX_TRANSCRIPTION_S)
            except AudioTooLong as exc:
                raise ApiError(413, f"the file: {exc}", "file", "audio_too_long") from None
            except UndecodableAudio as exc:
                raise ApiError(400, f"the file: {exc}", "file", "invalid_value") from None
            rt.metrics.audio_api_seconds.labels("transcriptions").inc(duration)
            language = _field(fields, "language", "") or None
            segments = await _recognize(rt, audio, language)
    except (ApiError, ClientDisconnect) as exc:
        return _answer(exc)
    place.release("ok")
    text = " ".join(s.hypothesis.text for s in segments if s.hypothesis.text)
    if response_format == "text":
        return PlainTextResponse(text + "\n")
    if response_format in ("srt", "vtt"):
        return PlainTextResponse(_subtitles(segments, response_format), media_type=f"text/{response_format}")
    usage = {"type": "duration", "seconds": round(duration, 3)}
    if response_format == "json":
        return JSONResponse({"text": text, "usage": usage})
    return JSONResponse({"task": "transcribe", "language": language, "duration": round(duration, 3),
                         "text": text, "segments": [_segment_json(i, s) for i, s in enumerate(segments)],
                         "usage": usage})


def _subtitles(segments: list[Segment], response_format: str) -> str:
    """The segments with text as SubRip cues (numbered from 1) or WebVTT cues (after its header)."""
    separator = "," if response_format == "srt" else "."

    def stamp(seconds: float) -> str:
        ms = round(seconds * 1000)
        return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{separator}{ms % 1000:03d}"

    cues = [f"{stamp(s.start)} --> {stamp(s.end)}\n{s.hypothesis.text}\n" for s in segments if s.hypothesis.text]
    if response_format == "srt":
        return "\n".join(f"{number}\n{cue}" for number, cue in enumerate(cues, 1))
    return "\n".join(["WEBVTT\n", *cues])


async def _recognize(rt, audio: np.ndarray, language: str | None) -> list[Segment]:
    endpointer = Endpointer(rt.settings.endpoint)
    utterances = await asyncio.to_thread(_utterances, endpointer, audio)
    stream = rt.recognizer.open(language)
    segments = []
    try:
        for start, end, utterance in utterances:
            await stream.accept(utterance)
            segments.append(Segment(start / ASR_RATE, end / ASR_RATE, await stream.finish()))
    except Exception as exc:
        log.exception("transcription failed")
        raise ApiError(500, f"recognition failed: {exc}", kind="server_error", code="recognition_failed") from exc
    finally:
        await stream.close()
    return segments


def _segment_json(index: int, segment: Segment) -> dict:
    hyp, text = segment.hypothesis, segment.hypothesis.text
    encoded = text.encode()
    return {
        "id": index,
        "seek": round(segment.start * 100),  # in 10 ms frames, as Whisper counts
        "start": round(segment.start, 3),
        "end": round(segment.end, 3),
        "text": text,
        "tokens": [],  # the recognizers' token ids mean nothing outside them
        "temperature": 0.0,  # greedy decoding
        "avg_logprob": math.log(hyp.confidence) if hyp.confidence else None,
        "compression_ratio": len(encoded) / len(zlib.compress(encoded)) if encoded else 0.0,
        "no_speech_prob": None,  # the endpointer cut it as speech; no per-segment measure is kept
        "confidence": hyp.confidence,
        "min_token_confidence": hyp.min_token_confidence,
        "model": hyp.model,
        "fallback": hyp.to_event()["fallback"],
    }
