"""The OpenAI-compatible audio routes, on the runtime's own engines: /v1/audio/speech (speech.py)
and /v1/audio/transcriptions (transcriptions.py), admitted and answered alike (admission.py)."""

from fastapi import APIRouter

from voicebot.frontends.openai_audio import speech, transcriptions
from voicebot.frontends.openai_audio.admission import AudioRequests

router = APIRouter(prefix="/v1/audio")
router.include_router(speech.router)
router.include_router(transcriptions.router)

__all__ = ["AudioRequests", "router"]
