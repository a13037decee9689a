"""The OpenAI Realtime protocol (GA event names) translated to and from voicebot's, without I/O.

`RealtimeTranslator.client_event(raw)` turns one Realtime client event into `Action`s: the session's
typed commands (voicebot.protocol's and voicebot.session.commands': audio, input end, a typed user
message answered, a reply truncated at the audio the client played, the responder's instructions,
the VAD threshold, ...) and events for the client (`Send`). `server_event(message)` turns what the
session says (its typed events, its 24 kHz frames) into Realtime server events.
voicebot/frontends/realtime.py does the I/O; docs/realtime.md lists every event, what voicebot adds and what
it does not do.
Ids: voicebot/frontends/realtime_items.py.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from voicebot.frontends.realtime_items import Response, finished, opened, truncation, user_item, user_text, where
from voicebot.frontends.realtime_session import (
    DEFAULT_TURN_DETECTION,
    INPUT_RATE,
    RealtimeError,
    decode_audio,
    endpointing,
    object_at,
    parse_update,
    session_object,
)
from voicebot.messages import AudioFrame
from voicebot.protocol import MAX_CHUNK_SECONDS, EndInput, Interrupt, ProtocolError, SessionStart, SessionUpdate, load_json
from voicebot.session import events as said
from voicebot.session.commands import AnswerText, AudioChunk, ClearInput, Command, SetInstructions, SetVadThreshold, TruncateReply
from voicebot.session.events import Outbound

# The largest binary message the session takes: 1 s at the input rate. An append of more is split.
CHUNK_BYTES = int(INPUT_RATE * MAX_CHUNK_SECONDS) * 2
# Bounds of what the translator keeps: typed messages waiting for response.create, and the
# responses a client may still truncate (older ones are forgotten, oldest first).
PENDING_TEXTS_MAX = 16
RESPONSES_KEPT = 8
# voicebot error codes that are the server's fault; the rest are the client's.
SERVER_ERRORS = {"engine_error", "reply_failed", "shutting_down", "busy"}


# ---- actions: what one client event asks of the session and the socket -----------------------


@dataclass(frozen=True)
class Send:
    """A Realtime server event for the client, straight away."""

    event: dict


Action = Command | Send  # a command for Session.handle, or an event for the client


# ---- state ----------------------------------------------------------------------------------


@dataclass
class _SpokenItem:
    """A user audio item: speech started, not yet transcribed."""

    item_id: str
    start_ms: int
    partial: str = ""


@dataclass
class RealtimeTranslator:
    model: str
    voices: Collection[str]  # the voices session.update may choose
    voice: str | None = None  # the session's, as voicebot last reported it
    instructions: str = ""
    language: str | None = None
    turn_detection: dict | None = field(default_factory=lambda: dict(DEFAULT_TURN_DETECTION))
    transcription: dict | None = field(default_factory=lambda: {"model": "voicebot", "language": None, "prompt": None})
    session_id: str | None = None
    input_bytes: int = 0  # all audio appended, at INPUT_RATE
    uncommitted_bytes: int = 0  # appended since the last commit or utterance
    _spoken: _SpokenItem | None = None  # speech started, not yet transcribed
    _last_item: str | None = None
    _pending_texts: list[str] = field(default_factory=list)  # typed user messages awaiting response.create
    _turn_answered: bool = False  # voicebot answered the latest spoken turn on its own; no response.create claimed it
    _commit_open: bool = False  # a commit was forwarded and its turn has not ended yet
    # A response.create that came while the commit's turn was still being recognised: answered at
    # that turn's end (its reply, or the error), so that it never overtakes `committed`. Its event_id.
    _create_held: str | None = None
    _responses: dict[str, Response] = field(default_factory=dict)  # by reply id, the last RESPONSES_KEPT
    _playing: Response | None = None  # the response whose frames are arriving
    _in_force: dict = field(default_factory=dict)  # voicebot's own view of the settings (its session.updated)
    _items: itertools.count = field(default_factory=lambda: itertools.count(1))
    _events: itertools.count = field(default_factory=lambda: itertools.count(1))

    # ---- the session's first message ----

    def start(self) -> SessionStart:
        """The session's first command: Realtime audio is 24 kHz."""
        return SessionStart(type="session.start", sample_rate=INPUT_RATE, endpointing=endpointing(self.turn_detection))

    # ---- client events --------------------------------------------------------------------

    def client_event(self, raw: str) -> list[Action]:
        """The actions one Realtime client event asks for; a refused event gives one `error`."""
        event_id = None
        try:
            try:
                event = load_json(raw)  # the input policy of every route (voicebot.protocol)
            except ProtocolError as exc:
                raise RealtimeError(exc.message, exc.code) from None
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise RealtimeError("an event must be a JSON object with a string 'type'", "invalid_event", "type")
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            handler = self._CLIENT_EVENTS.get(event["type"])
            if handler is None:
                raise RealtimeError(f"unknown or unsupported event type {event['type'][:80]!r}", "unknown_event_type", "type")
            return handler(self, event)
        except RealtimeError as exc:
            return [Send(self.error(exc.message, exc.code, exc.param, event_id=event_id))]

    def _session_update(self, event: dict) -> list[Action]:
        change = parse_update(object_at(event, "session", "session"), self.session(), self.voices)
        # Checked in full: now take it all.
        actions: list[Action] = []
        if change.instructions is not None:
            self.instructions = change.instructions
            actions.append(SetInstructions(change.instructions or None))
        self.turn_detection, self.transcription = change.turn_detection, change.transcription
        if change.transcription is not None and change.transcription.get("language"):
            self.language = change.transcription["language"]
        if change.turn_detection is not None and change.turn_detection.get("threshold") is not None:
            actions.append(SetVadThreshold(change.turn_detection["threshold"]))
        # Answered by session.updated.
        actions.append(SessionUpdate(type="session.update", endpointing=endpointing(self.turn_detection), voice=change.voice,
                                     language=self.language or None))
        return actions

    def _append(self, event: dict) -> list[Action]:
        pcm = decode_audio(event)
        self.input_bytes += len(pcm)
        self.uncommitted_bytes += len(pcm)
        return [AudioChunk(pcm[i : i + CHUNK_BYTES]) for i in range(0, len(pcm), CHUNK_BYTES)]

    def _commit(self, event: dict) -> list[Action]:
        if self.uncommitted_bytes == 0:
            raise RealtimeError("the input audio buffer is empty", "input_audio_buffer_commit_empty")
        self.uncommitted_bytes = 0
        self._commit_open = True
        return [EndInput(type="input.end")]  # its utterance's asr.final brings `committed`

    def _clear(self, event: dict) -> list[Action]:
        # The buffer only: utterances already committed (at their end, `_final`; under semantic_vad
        # before the turn is decided) are items, as in OpenAI's API, and their turn is answered.
        self.uncommitted_bytes = 0  # what is appended after the clear is a new buffer
        return [ClearInput()]  # `cleared` when the session has dropped it (_cleared)

    def _item_create(self, event: dict) -> list[Action]:
        item = object_at(event, "item", "item")
        text = user_text(item)
        if len(self._pending_texts) >= PENDING_TEXTS_MAX:
            raise RealtimeError(f"{PENDING_TEXTS_MAX} messages already wait for response.create", "too_many_items", "item")
        self._pending_texts.append(text)
        item_id = item["id"] if isinstance(item.get("id"), str) and item["id"] else f"item_t{next(self._items)}"
        stored = user_item(item_id, {"type": "input_text", "text": text})
        previous, self._last_item = self._last_item, item_id
        return [Send(self._event("conversation.item.added", previous_item_id=previous, item=stored)),
                Send(self._event("conversation.item.done", previous_item_id=previous, item=stored))]

    def _item_truncate(self, event: dict) -> list[Action]:
        response, audio_end_ms = truncation(event, self._responses.values())
        return [TruncateReply(response.reply_id, audio_end_ms)]  # answered by reply.truncated (_truncated)

    def _response_create(self, event: dict) -> list[Action]:
        if self._pending_texts:
            text, self._pending_texts = "\n".join(self._pending_texts), []
            return [AnswerText(text)]
        if self._turn_answered:
            # voicebot answers every spoken turn itself: this response.create asks for that reply.
            self._turn_answered = False
            return []
        if self._commit_open and self._create_held is None:
            # Push-to-talk's commit then response.create at once: the commit's turn is still being
            # recognised; it answers this (_turn_end), after its `committed`.
            self._create_held = event.get("event_id") if isinstance(event.get("event_id"), str) else ""
            return []
        raise RealtimeError("nothing new to respond to: add a user message or commit speech first",
                            "response_create_nothing_new")

    def _response_cancel(self, event: dict) -> list[Action]:
        if not any(not r.done for r in self._responses.values()):
            raise RealtimeError("there is no response in progress", "response_cancel_not_active")
        return [Interrupt(type="interrupt")]

    _CLIENT_EVENTS = {
        "session.update": _session_update,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": _clear,
        "conversation.item.create": _item_create,
        "conversation.item.truncate": _item_truncate,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
    }

    # ---- server side: voicebot's events and frames ------------------------------------------

    def server_event(self, message: Outbound) -> list[dict]:
        """What one event or frame of the session is in Realtime server events."""
        if isinstance(message, AudioFrame):
            return self._audio(message.pcm)
        handler = self._SERVER_EVENTS.get(type(message))
        return handler(self, message) if handler else []  # pong, state.reset: nothing to say

    def _audio(self, pcm: bytes) -> list[dict]:
        response = self._playing
        if response is None or response.done:
            return []  # not reachable: frames come between audio.start and its end
        response.audio_bytes += len(pcm)
        return [self._event("response.output_audio.delta", **where(response), delta=base64.b64encode(pcm).decode())]

    def _ready(self, event: said.SessionReady) -> list[dict]:
        self.session_id = event.session_id
        self.voice = event.voice
        return [self._event("session.created", session=self.session())]

    def _updated(self, event: said.SessionUpdated) -> list[dict]:
        self.voice = event.voice
        self._in_force = {"responder": event.responder, "language": event.language, "turn": event.turn,
                          "endpoint_silence_ms": event.endpoint_silence_ms, "barge_in_min_ms": event.barge_in_min_ms}
        return [self._event("session.updated", session=self.session())]

    def _speech_started(self, event: said.SpeechStarted) -> list[dict]:
        self._spoken = _SpokenItem(f"item_{event.utterance_id}", self._input_ms())
        if self.turn_detection is None:
            return []  # VAD off (push-to-talk): OpenAI sends no speech_started/stopped, only `committed`
        return [self._event("input_audio_buffer.speech_started", audio_start_ms=self._spoken.start_ms,
                            item_id=self._spoken.item_id)]

    def _partial(self, event: said.AsrPartial) -> list[dict]:
        utterance = self._spoken
        if utterance is None or self.transcription is None or not event.text.startswith(utterance.partial):
            return []  # a revised partial has no delta; `completed` carries the final text
        delta, utterance.partial = event.text[len(utterance.partial):], event.text
        if not delta:
            return []
        return [self._event("conversation.item.input_audio_transcription.delta", item_id=utterance.item_id,
                            content_index=0, delta=delta)]

    def _final(self, event: said.AsrFinal) -> list[dict]:
        item_id = f"item_{event.utterance_id}"
        start_ms = self._spoken.start_ms if self._spoken else self._input_ms()
        end_ms = self._input_ms()
        self._spoken = None
        self.uncommitted_bytes = 0
        hypothesis = event.hypothesis
        text = hypothesis["text"]
        previous, self._last_item = self._last_item, item_id
        item = user_item(item_id, {"type": "input_audio", "transcript": text if self.transcription is not None else None})
        stopped = [] if self.turn_detection is None else [
            self._event("input_audio_buffer.speech_stopped", audio_end_ms=end_ms, item_id=item_id)]
        events = [
            *stopped,
            self._event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id),
            self._event("conversation.item.added", previous_item_id=previous, item=item),
            self._event("conversation.item.done", previous_item_id=previous, item=item),
        ]
        if self.transcription is not None:
            events.append(self._event(
                "conversation.item.input_audio_transcription.completed", item_id=item_id, content_index=0, transcript=text,
                usage={"type": "duration", "seconds": round((end_ms - start_ms) / 1000, 3)},
                voicebot={"confidence": hypothesis["confidence"], "model": hypothesis["model"], "fallback": hypothesis["fallback"],
                          "gate_muted_ms": event.gate_muted_ms}))
        return events

    def _cleared(self, event: said.InputCleared) -> list[dict]:
        """The session dropped the utterance in progress, if any: it has no item, no transcript."""
        if self._spoken is not None and self._spoken.item_id == f"item_{event.utterance_id}":
            self._spoken = None
        return [self._event("input_audio_buffer.cleared")]

    def _turn_end(self, event: said.TurnEnd) -> list[dict]:
        held, self._create_held, self._commit_open = self._create_held, None, False
        if held is not None:  # a response.create waited for this turn: it claims its reply, or learns there is none
            if event.text:
                return []
            return [self.error("nothing new to respond to: the committed audio held no words",
                               "response_create_nothing_new", event_id=held or None)]
        if event.text:
            self._turn_answered = True  # its reply follows (a turn may hold several utterances)
        return []

    def _reply_delta(self, event: said.ReplyDelta) -> list[dict]:
        events, response = self._response(event.reply_id)
        response.transcript += event.text
        events.append(self._event("response.output_audio_transcript.delta", **where(response), delta=event.text))
        return events

    def _reply_done(self, event: said.ReplyDone) -> list[dict]:
        events, response = self._response(event.reply_id)
        if not event.text:
            events += self._finish(response, "completed")  # nothing to speak: no audio follows
        return events

    def _audio_start(self, event: said.AudioStart) -> list[dict]:
        events, self._playing = self._response(event.reply_id)
        return events

    def _audio_end(self, event: said.AudioEnd) -> list[dict]:
        events, response = self._response(event.reply_id)
        return events + self._finish(response, "completed")

    def _interrupted(self, event: said.AudioInterrupted) -> list[dict]:
        events, response = self._response(event.reply_id)
        reason = "turn_detected" if event.reason == "barge_in" else "client_cancelled"
        extra = {"played_ms": event.played_ms, "heard_text": event.heard_text, "frames_sent": event.frames_sent,
                 "frames_dropped": event.frames_dropped}
        return events + self._finish(response, "cancelled", {"type": "cancelled", "reason": reason}, extra)

    def _truncated(self, event: said.ReplyTruncated) -> list[dict]:
        return [self._event("conversation.item.truncated", item_id=f"item_{event.reply_id}", content_index=0,
                            audio_end_ms=event.audio_end_ms, voicebot={"heard_text": event.heard_text})]

    def _truncate_refused(self, event: said.TruncateRefused) -> list[dict]:
        return [self.error("only the latest response can be truncated", "item_truncate_invalid_item_id", "item_id")]

    def _error(self, event: said.Error) -> list[dict]:
        extra = event.details
        events = [self.error(event.message, event.code, kind="server_error" if event.code in SERVER_ERRORS else None,
                             voicebot=extra or None)]
        reply_id = extra.get("reply_id")
        if reply_id and event.code == "engine_error":  # the reply ended with it (reply_failed: a fallback line follows)
            created, response = self._response(reply_id)
            events = created + events
            if response is not self._playing:  # no audio.end follows a reply that sent no frame
                events += self._finish(response, "failed", {"type": "failed", "error": {"type": "server_error",
                                                                                         "code": "engine_error"}})
        return events

    _SERVER_EVENTS = {
        said.SessionReady: _ready,
        said.SessionUpdated: _updated,
        said.SpeechStarted: _speech_started,
        said.AsrPartial: _partial,
        said.AsrFinal: _final,
        said.TurnEnd: _turn_end,
        said.InputCleared: _cleared,
        said.ReplyDelta: _reply_delta,
        said.ReplyDone: _reply_done,
        said.AudioStart: _audio_start,
        said.AudioEnd: _audio_end,
        said.AudioInterrupted: _interrupted,
        said.ReplyTruncated: _truncated,
        said.TruncateRefused: _truncate_refused,
        said.Error: _error,
    }

    # ---- responses -----------------------------------------------------------------------

    def _response(self, reply_id: str) -> tuple[list[dict], Response]:
        """The response of a voicebot reply, and the events that open it if it is new."""
        if (response := self._responses.get(reply_id)) is not None:
            return [], response
        response = self._responses[reply_id] = Response(reply_id)
        while len(self._responses) > RESPONSES_KEPT:
            del self._responses[next(iter(self._responses))]
        previous, self._last_item = self._last_item, response.item_id
        return opened(response, previous, self.voice, self._event), response

    def _finish(self, response: Response, status: str, details: dict | None = None, extra: dict | None = None) -> list[dict]:
        if response.done:
            return []
        response.done = True
        if self._playing is response:
            self._playing = None
        return finished(response, self.voice, status, details, extra, self._event)

    # ---- helpers -------------------------------------------------------------------------

    def session(self) -> dict:
        """The session object of session.created and session.updated: what is in force."""
        return session_object(self.session_id, self.model, self.instructions, self.transcription, self.turn_detection,
                              self.voice, self._in_force)

    def error(self, message: str, code: str, param: str | None = None, *, kind: str | None = None,
              event_id: str | None = None, voicebot: dict | None = None) -> dict:
        """An `error` event in OpenAI's shape; `voicebot` holds what voicebot's own error adds."""
        body = {"type": kind or "invalid_request_error", "code": code, "message": message, "param": param, "event_id": event_id}
        return self._event("error", error=body, **({"voicebot": voicebot} if voicebot else {}))

    def _input_ms(self) -> int:
        return self.input_bytes * 1000 // (2 * INPUT_RATE)

    def _event(self, kind: str, **fields: Any) -> dict:
        return {"type": kind, "event_id": f"event_{next(self._events)}", **fields}
