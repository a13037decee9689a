"""The shapes of a Realtime response and its assistant item, as the server events carry them.

Ids: a user audio item is `item_<utterance id>`, a typed one `item_t<n>` unless the client named it,
a response `resp_<reply id>` and its assistant item `item_<reply id>`, which has one audio content
part (index 0) whose transcript is what the reply said.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from voicebot.audio.rates import SPEAK_RATE
from voicebot.frontends.realtime_session import PCM_FORMAT, RealtimeError

Event = Callable[..., dict]  # the translator's event maker: a kind and fields, numbered with an event_id


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


def opened(response: Response, previous_item: str | None, voice: str | None, event: Event) -> list[dict]:
    """The events that open a response: it is created, its item added, its content part begun."""
    return [
        event("response.created", response=response_object(response, voice, "in_progress")),
        event("response.output_item.added", response_id=response.id, output_index=0, item=assistant_item(response, "in_progress")),
        event("conversation.item.added", previous_item_id=previous_item, item=assistant_item(response, "in_progress")),
        event("response.content_part.added", **where(response), part=content_part(response)),
    ]


def finished(response: Response, voice: str | None, status: str, details: dict | None, extra: dict | None,
             event: Event) -> list[dict]:
    """The events that end a response with `status` (completed, cancelled, failed)."""
    item_status = "completed" if status == "completed" else "incomplete"
    at = where(response)
    return [
        event("response.output_audio.done", **at),
        event("response.output_audio_transcript.done", **at, transcript=response.transcript),
        event("response.content_part.done", **at, part=content_part(response)),
        event("response.output_item.done", response_id=response.id, output_index=0, item=assistant_item(response, item_status)),
        event("conversation.item.done", previous_item_id=None, item=assistant_item(response, item_status)),
        event("response.done", response=response_object(response, voice, status, details, extra)),
    ]


def user_item(item_id: str, content: dict) -> dict:
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": "completed", "role": "user",
            "content": [content]}


def user_text(item: dict) -> str:
    """The text of a conversation.item.create's item: a user message of input_text parts."""
    if item.get("type") != "message" or item.get("role") != "user":
        raise RealtimeError("only user messages can be added (type message, role user)", "unsupported_value", "item")
    content = item.get("content")
    if not isinstance(content, list) or not content or not all(
            isinstance(piece, dict) and piece.get("type") == "input_text" and isinstance(piece.get("text"), str) for piece in content):
        raise RealtimeError("a user message's content must be input_text parts", "unsupported_value", "item.content")
    text = " ".join(piece["text"] for piece in content).strip()
    if not text:
        raise RealtimeError("the message has no text", param="item.content")
    return text


def truncation(event: dict, responses: Iterable[Response]) -> tuple[Response, int]:
    """A conversation.item.truncate, checked against the responses a client may still truncate:
    the response of its item, and the audio_end_ms it played of it."""
    item_id = event.get("item_id")
    audio_end_ms = event.get("audio_end_ms")
    response = next((r for r in responses if r.item_id == item_id), None)
    if response is None:
        raise RealtimeError(f"no assistant item {str(item_id)[:64]!r} to truncate", "item_truncate_invalid_item_id", "item_id")
    if not isinstance(audio_end_ms, int) or isinstance(audio_end_ms, bool) or audio_end_ms < 0:
        raise RealtimeError("audio_end_ms must be a non-negative integer", param="audio_end_ms")
    if event.get("content_index", 0) != 0:
        raise RealtimeError("an assistant item here has one content part: content_index 0", param="content_index")
    if audio_end_ms > response.audio_ms:
        raise RealtimeError(f"audio_end_ms {audio_end_ms} is past the {response.audio_ms} ms of audio sent",
                            "audio_end_ms_out_of_range", "audio_end_ms")
    return response, audio_end_ms
