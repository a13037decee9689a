"""`POST /v1/audio/transcriptions`: recognize an uploaded file with the configured recognizer.

The multipart body is read as it streams, up to MAX_UPLOAD_BYTES (413 as soon as it passes it,
nothing more written to disk); the file is decoded with FFmpeg whatever its format
(voicebot/audio/files.py: its header's rate, channels and duration checked before any decoding,
MAX_TRANSCRIPTION_S at most), cut into utterances with the Silero endpointer (the server's
`endpoint` settings), and each is recognized: `response_format` json, text, srt, vtt or
verbose_json, whose segments carry the recognizer's own `confidence` (geometric mean of token
posteriors, null where the engine has none; `avg_logprob` is its log) and `model`. The recognizer
runs on its own worker; the endpointer and the file decoder run in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from voicebot.asr.base import Hypothesis
from voicebot.audio.endpoint import WINDOW, Endpointer, EventKind
from voicebot.audio.files import SAMPLE_RATE as ASR_RATE
from voicebot.audio.files import AudioTooLong, UndecodableAudio, decode_file
from voicebot.frontends.openai_audio.admission import ApiError, admit, answer, refusing

log = logging.getLogger(__name__)

router = APIRouter()

MAX_UPLOAD_BYTES = 25 * 2**20  # OpenAI's limit for a transcription upload
MAX_FORM_OVERHEAD_BYTES = 2**16  # the form's other fields and part headers, on top of the file
MAX_TRANSCRIPTION_S = 3600.0  # an hour: 230 MB as 16 kHz float32, what one request may hold
TRANSCRIPTION_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


@dataclass(frozen=True)
class TimedHypothesis:
    """What the recognizer heard in one utterance of the file, and where it lies (seconds)."""

    start: float
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
        rt, place = admit(request, "transcriptions")
    except ApiError as exc:
        return exc.response()
    try:
        with refusing(place):
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
        return answer(exc)
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


def _subtitles(segments: list[TimedHypothesis], response_format: str) -> str:
    """The segments with text as SubRip cues (numbered from 1) or WebVTT cues (after its header)."""
    separator = "," if response_format == "srt" else "."

    def stamp(seconds: float) -> str:
        ms = round(seconds * 1000)
        return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{separator}{ms % 1000:03d}"

    cues = [f"{stamp(s.start)} --> {stamp(s.end)}\n{s.hypothesis.text}\n" for s in segments if s.hypothesis.text]
    if response_format == "srt":
        return "\n".join(f"{number}\n{cue}" for number, cue in enumerate(cues, 1))
    return "\n".join(["WEBVTT\n", *cues])


async def _recognize(rt, audio: np.ndarray, language: str | None) -> list[TimedHypothesis]:
    endpointer = Endpointer(rt.settings.endpoint)
    utterances = await asyncio.to_thread(_utterances, endpointer, audio)
    stream = rt.recognizer.open(language)
    segments = []
    try:
        for start, end, utterance in utterances:
            await stream.accept(utterance)
            segments.append(TimedHypothesis(start / ASR_RATE, end / ASR_RATE, await stream.finish()))
    except Exception as exc:
        log.exception("transcription failed")
        raise ApiError(500, f"recognition failed: {exc}", kind="server_error", code="recognition_failed") from exc
    finally:
        await stream.close()
    return segments


def _segment_json(index: int, segment: TimedHypothesis) -> dict:
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
