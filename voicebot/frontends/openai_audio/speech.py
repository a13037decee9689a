"""`POST /v1/audio/speech`: speak `input` with the configured synthesizer, streamed as it is made.

The audio is encoded as it comes (voicebot/audio/encode.py): `response_format` mp3 (the default,
as OpenAI's), opus (Ogg), aac (ADTS), flac, wav (a header whose sizes say "unknown length", then
the samples) or pcm (24 kHz s16le mono, as OpenAI's); `stream_format` audio (the bytes) or sse (the
same bytes, base64 in `speech.audio.delta` events, then `speech.audio.done`). `voice` is any
configured voice; `model` is accepted and not used (the server has one synthesizer). `speed` other
than 1 and `instructions` are refused: no engine here takes them per request. The body is read up
to MAX_SPEECH_BODY_BYTES and no further (413 past it). The synthesizer runs on its own worker;
a compressed format is encoded on a thread.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from voicebot.audio import encode
from voicebot.audio.resample import float_to_pcm16
from voicebot.frontends.openai_audio.admission import ApiError, Place, admit, answer, refusing
from voicebot.tts.base import SAMPLE_RATE as TTS_RATE

log = logging.getLogger(__name__)

router = APIRouter()

MAX_INPUT_CHARS = 4096  # OpenAI's limit for `input`
# A speech request's whole JSON body: 4096 characters of input, each at most 12 bytes as a JSON
# escape (a surrogate pair), are 48 KiB; the rest of the fields are small.
MAX_SPEECH_BODY_BYTES = 2**16 * 2


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


@router.post("/speech", response_model=None)
async def speech(request: Request) -> Response:
    try:
        rt, place = admit(request, "speech")
    except ApiError as exc:
        return exc.response()
    try:
        with refusing(place):
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
        return answer(exc)
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
async def _streaming(rest: AsyncIterator[bytes], encoder: encode.SpeechEncoder, place: Place):
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


async def _bytes(first: bytes, rest: AsyncIterator[bytes], encoder: encode.SpeechEncoder, place: Place) -> AsyncIterator[bytes]:
    async with _streaming(rest, encoder, place):
        async for data in _encoded(first, rest, encoder):
            yield data


async def _sse(first: bytes, rest: AsyncIterator[bytes], encoder: encode.SpeechEncoder, place: Place) -> AsyncIterator[bytes]:
    """The same bytes as the audio stream, base64 in `speech.audio.delta` events."""

    def event(body: dict) -> bytes:
        return f"data: {json.dumps(body)}\n\n".encode()

    async with _streaming(rest, encoder, place):
        async for data in _encoded(first, rest, encoder):
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        yield event({"type": "speech.audio.done"})
