"""The shapes of a Realtime response and its assistant item, as the server events carry them.

Ids: a response is `resp_<reply id>`, its assistant item `item_<reply id>`; each has one audio
content part (index 0) whose transcript is what the reply said.
"""

from __future__ import annotations

from dataclasses import dataclass

from voicebot.audio.rates import SPEAK_RATE
from voicebot.frontends.realtime_session import PCM_FORMAT


@dataclass
class Response:
    """A voicebot reply as a Realtime response: its ids, and what of it was sent."""

    reply_id: str
    audio_bytes: int = 0
    transcript: str = ""
    done: bool = False

    @property
    def id(self) -> str:
        return f"resp_{self.reply_id}"

    @property
    def item_id(self) -> str:
        return f"item_{self.reply_id}"

    @property
    def audio_ms(self) -> int:
        return self.audio_bytes * 1000 // (2 * SPEAK_RATE)


def where(response: Response) -> dict:
    return {"response_id": response.id, "item_id": response.item_id, "output_index": 0, "content_index": 0}


def content_part(response: Response) -> dict:
    return {"type": "audio", "transcript": response.transcript}


def assistant_item(response: Response, status: str) -> dict:
    return {"id": response.item_id, "object": "realtime.item", "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_audio", "transcript": response.transcript}]}


def response_object(response: Response, voice: str | None, status: str, details: dict | None = None,
                    extra: dict | None = None) -> dict:
    body = {"object": "realtime.response", "id": response.id, "status": status, "status_details": details,
            "output": [] if status == "in_progress" else [assistant_item(response, "completed" if status == "completed" else "incomplete")],
            "conversation_id": None, "output_modalities": ["audio"], "max_output_tokens": "inf",
            "audio": {"output": {"format": PCM_FORMAT, "voice": voice}}, "usage": None, "metadata": None}
    if extra:
        body["voicebot"] = extra
    return body
