"""The Realtime translator without sockets: client events to the session's typed commands, the
session's typed events to Realtime server events."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from tests.frontends.fakes import RecordingSession
from voicebot.frontends.realtime import RealtimeFrontEnd
from voicebot.messages import AudioFrame
from voicebot.metrics import Metrics
from voicebot.protocol import EndInput, EndpointingUpdate, Interrupt, SessionUpdate
from voicebot.frontends.realtime_events import CHUNK_BYTES, RealtimeTranslator, Send
from voicebot.frontends.realtime_session import MANUAL_SILENCE_MS
from voicebot.session import events as said
from voicebot.session.commands import AnswerText, ClearInput, SetInstructions, SetVadThreshold, TruncateReply


def ready() -> said.SessionReady:
    return said.SessionReady("abc", "secret", 1, 24000, 24000, 200, "en", "echo", False)


def translator() -> RealtimeTranslator:
    t = RealtimeTranslator("gpt-realtime", ["en", "zh"])
    t.server_event(ready())
    return t


def client(t: RealtimeTranslator, event: dict | str) -> list:
    return t.client_event(event if isinstance(event, str) else json.dumps(event))


def server(t: RealtimeTranslator, event) -> list[dict]:
    return t.server_event(event)


def final(text: str, confidence: float | None = None, model: str = "m") -> said.AsrFinal:
    return said.AsrFinal("u1", {"text": text, "confidence": confidence, "model": model, "fallback": None}, 0, {})


def turn_end(text: str, by: str = "silence") -> said.TurnEnd:
    return said.TurnEnd("u1", by, None, text, {})


def commands(actions: list) -> list:
    """What a client event hands the session (the rest is Send: for the client)."""
    return [a for a in actions if not isinstance(a, Send)]


def error_of(actions: list) -> dict:
    (action,) = actions
    assert isinstance(action, Send) and action.event["type"] == "error"
    assert set(action.event["error"]) == {"type", "code", "message", "param", "event_id"}
    return action.event["error"]


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_the_session_starts_at_24_khz_with_server_vad_and_reports_itself():
    t = RealtimeTranslator("gpt-realtime", ["en"])
    start = t.start().model_dump(exclude_none=True)
    assert start == {"type": "session.start", "sample_rate": 24000, "endpointing": {"turn": "silence", "endpoint_silence_ms": 500}}
    (created,) = t.server_event(ready())
    assert created["type"] == "session.created" and created["event_id"]
    session = created["session"]
    assert session["id"] == "sess_abc" and session["model"] == "gpt-realtime" and "secret" not in json.dumps(created)
    assert session["audio"]["input"]["format"] == session["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"


def test_session_update_becomes_the_sessions_settings_and_hooks():
    t = translator()
    actions = client(t, {"type": "session.update", "session": {
        "type": "realtime", "instructions": "Be brief.",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                            "turn_detection": {"type": "server_vad", "threshold": 0.7, "silence_duration_ms": 800},
                            "transcription": {"model": "whisper-1", "language": "zh"}},
                  "output": {"voice": "zh"}}}})
    assert SetInstructions("Be brief.") in actions and SetVadThreshold(0.7) in actions
    assert commands(actions)[-1] == SessionUpdate(type="session.update", voice="zh", language="zh",
                                                  endpointing=EndpointingUpdate(turn="silence", endpoint_silence_ms=800))
    (updated,) = server(t, said.SessionUpdated(voice="zh", responder="echo", language="zh", turn="silence",
                                               endpoint_silence_ms=800, barge_in_min_ms=300))
    session = updated["session"]
    assert session["instructions"] == "Be brief." and session["audio"]["output"]["voice"] == "zh"
    assert session["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 800
    assert session["voicebot"]["turn"] == "silence"


@pytest.mark.parametrize("detection, endpointing", [
    (None, {"turn": "silence", "endpoint_silence_ms": MANUAL_SILENCE_MS}),
    ({"type": "semantic_vad", "eagerness": "high"}, {"turn": "smart"}),
])
def test_manual_and_semantic_turn_detection(detection, endpointing):
    t = translator()
    actions = client(t, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": detection}}}})
    assert commands(actions)[0].endpointing.model_dump(exclude_none=True) == endpointing


@pytest.mark.parametrize("session, param", [
    ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "session.audio.input.format"),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.output.format"),
    ({"audio": {"output": {"voice": "alloy"}}}, "session.audio.output.voice"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 50}}}},
     "session.audio.input.turn_detection.silence_duration_ms"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 1.5}}}}, "session.audio.input.turn_detection.threshold"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": False}}}},
     "session.audio.input.turn_detection.create_response"),
    ({"output_modalities": ["text"]}, "session.output_modalities"),
    ({"tools": [{"type": "function", "name": "f"}]}, "session.tools"),
    ({"instructions": 7}, "session.instructions"),
])
def test_a_refused_session_update_changes_nothing(session, param):
    t = translator()
    before = t.session()
    error = error_of(client(t, {"type": "session.update", "event_id": "ev1", "session": {"instructions": "x", **session}}))
    assert error["param"] == param and error["event_id"] == "ev1" and error["type"] == "invalid_request_error"
    assert t.session() == before


def test_append_splits_into_chunks_the_session_takes():
    t = translator()
    pcm = bytes(range(250)) * 196  # 49000 bytes: just over 1 s at 24 kHz, and just under the text frame limit in base64
    chunks = [c.pcm for c in commands(client(t, {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))]
    assert [len(c) for c in chunks] == [CHUNK_BYTES, len(pcm) - CHUNK_BYTES] and b"".join(chunks) == pcm


def test_an_append_over_the_text_frame_limit_is_refused():
    pcm = bytes(2 * CHUNK_BYTES)  # 2 s: 128 000 characters of base64
    error = error_of(client(translator(), {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
    assert error["code"] == "frame_too_large"


@pytest.mark.parametrize("event, code", [
    ("not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    ({"type": "bogus"}, "unknown_event_type"),
    ({"type": "input_audio_buffer.append", "audio": "%%%"}, "invalid_value"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}, "invalid_value"),
    ({"type": "input_audio_buffer.append"}, "invalid_value"),
    ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
    ({"type": "response.create"}, "response_create_nothing_new"),
    ({"type": "response.cancel"}, "response_cancel_not_active"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", "content": []}}, "unsupported_value"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                   "content": [{"type": "input_audio", "audio": ""}]}}, "unsupported_value"),
    ({"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0, "audio_end_ms": 0},
     "item_truncate_invalid_item_id"),
])
def test_bad_events_get_one_error(event, code):
    assert error_of(client(translator(), event))["code"] == code


def test_commit_ends_the_input_and_the_utterance_brings_the_items():
    t = translator()
    client(t, {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\0\0" * 24000).decode()})
    assert commands(client(t, {"type": "input_audio_buffer.commit"})) == [EndInput(type="input.end")]
    started = server(t, said.SpeechStarted("u1"))
    assert started[0]["item_id"] == "item_u1" and started[0]["audio_start_ms"] == 1000
    deltas = server(t, said.AsrPartial("u1", "hello")) + server(t, said.AsrPartial("u1", "hello there"))
    assert [d["delta"] for d in deltas] == ["hello", " there"]
    assert server(t, said.AsrPartial("u1", "yellow")) == []  # a revision has no delta
    final_events = server(t, final("hello there", 0.9, "paraformer"))
    assert types(final_events) == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "conversation.item.added",
                            "conversation.item.done", "conversation.item.input_audio_transcription.completed"]
    completed = final_events[-1]
    assert completed["transcript"] == "hello there" and completed["voicebot"]["confidence"] == 0.9
    assert completed["voicebot"]["model"] == "paraformer"
    assert final_events[1]["item_id"] == "item_u1" and final_events[1]["previous_item_id"] is None
    # voicebot answers the turn itself; one response.create asks for that reply, a second has nothing new.
    server(t, turn_end("hello there"))
    assert client(t, {"type": "response.create"}) == []
    assert error_of(client(t, {"type": "response.create"}))["code"] == "response_create_nothing_new"


def test_no_transcription_events_when_transcription_is_off():
    t = translator()
    client(t, {"type": "session.update", "session": {"audio": {"input": {"transcription": None}}}})
    server(t, said.SpeechStarted("u1"))
    assert server(t, said.AsrPartial("u1", "hi")) == []
    assert "conversation.item.input_audio_transcription.completed" not in types(server(t, final("hi")))


def test_clear_mid_utterance_drops_it_and_is_answered_when_the_session_has():
    t = translator()
    client(t, {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\0\0" * 2400).decode()})
    server(t, said.SpeechStarted("u1"))
    assert client(t, {"type": "input_audio_buffer.clear"}) == [ClearInput()]  # no refusal, no answer yet
    assert t.uncommitted_bytes == 0
    assert server(t, said.AsrPartial("u1", "hel")) != []  # heard before the session dropped it
    assert types(server(t, said.InputCleared("u1"))) == ["input_audio_buffer.cleared"]
    assert server(t, said.AsrPartial("u1", "hello")) == []  # its item is gone
    assert types(server(t, said.InputCleared(None))) == ["input_audio_buffer.cleared"]  # nothing in progress


def test_typed_messages_wait_for_response_create():
    t = translator()
    sent = client(t, {"type": "conversation.item.create", "item": {"id": "mine", "type": "message", "role": "user",
                                                                  "content": [{"type": "input_text", "text": "hi"}]}})
    assert types([a.event for a in sent]) == ["conversation.item.added", "conversation.item.done"]
    assert sent[0].event["item"]["id"] == "mine"
    client(t, {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                            "content": [{"type": "input_text", "text": "again"}]}})
    assert client(t, {"type": "response.create", "response": {}}) == [AnswerText("hi\nagain")]


def test_a_reply_becomes_one_response_with_audio_and_transcript():
    t = translator()
    opened = server(t, said.ReplyDelta("r1", "Hi"))
    assert types(opened) == ["response.created", "response.output_item.added", "conversation.item.added",
                             "response.content_part.added", "response.output_audio_transcript.delta"]
    assert opened[0]["response"]["id"] == "resp_r1" and opened[0]["response"]["status"] == "in_progress"
    assert server(t, said.ReplyDelta("r1", " there"))[0]["delta"] == " there"
    assert server(t, said.ReplyDone("r1", "Hi there")) == []
    assert server(t, said.AudioStart("r1", 24000, 200)) == []
    frame = bytes(9600)
    (delta,) = t.server_event(AudioFrame(frame))
    assert delta["type"] == "response.output_audio.delta" and base64.b64decode(delta["delta"]) == frame
    assert (delta["response_id"], delta["item_id"]) == ("resp_r1", "item_r1")
    done = server(t, said.AudioEnd("r1", 1, 4800, {}))
    assert types(done) == ["response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
                           "response.output_item.done", "conversation.item.done", "response.done"]
    assert done[1]["transcript"] == "Hi there"
    response = done[-1]["response"]
    assert response["status"] == "completed" and response["output"][0]["content"][0]["transcript"] == "Hi there"


def test_an_interrupted_reply_is_cancelled_and_can_be_truncated_within_its_audio():
    t = translator()
    server(t, said.ReplyDelta("r1", "Hello there"))
    server(t, said.AudioStart("r1", 24000, 200))
    for _ in range(3):
        t.server_event(AudioFrame(bytes(9600)))  # 600 ms
    assert commands(client(t, {"type": "response.cancel"})) == [Interrupt(type="interrupt")]
    done = server(t, said.AudioInterrupted("r1", reason="barge_in", frames_sent=3, frames_dropped=4, played_ms=600,
                                           heard_text="Hello"))
    response = done[-1]["response"]
    assert response["status"] == "cancelled" and response["status_details"]["reason"] == "turn_detected"
    assert response["voicebot"]["heard_text"] == "Hello" and response["voicebot"]["frames_dropped"] == 4
    assert error_of(client(t, {"type": "response.cancel"}))["code"] == "response_cancel_not_active"
    truncate = {"type": "conversation.item.truncate", "item_id": "item_r1", "content_index": 0}
    assert client(t, {**truncate, "audio_end_ms": 400}) == [TruncateReply("r1", 400)]
    assert error_of(client(t, {**truncate, "audio_end_ms": 601}))["code"] == "audio_end_ms_out_of_range"
    assert error_of(client(t, {**truncate, "audio_end_ms": -1}))["param"] == "audio_end_ms"
    (truncated,) = server(t, said.ReplyTruncated("r1", 400, "Hel"))
    assert (truncated["type"], truncated["item_id"], truncated["audio_end_ms"]) == ("conversation.item.truncated", "item_r1", 400)
    assert truncated["voicebot"] == {"heard_text": "Hel"}
    (refused,) = server(t, said.TruncateRefused("r0"))
    assert (refused["error"]["code"], refused["error"]["param"]) == ("item_truncate_invalid_item_id", "item_id")


def test_errors_take_openais_shape_and_a_failed_reply_ends_its_response():
    t = translator()
    (error,) = server(t, said.Error("invalid_message", "bad"))
    assert error["error"] == {"type": "invalid_request_error", "code": "invalid_message", "message": "bad", "param": None,
                              "event_id": None}
    events = server(t, said.Error("engine_error", "tts died", {"reply_id": "r2"}))
    assert types(events)[0] == "response.created" and "error" in types(events)
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["id"] == "resp_r2"
    assert next(e for e in events if e["type"] == "error")["error"]["type"] == "server_error"
    # A responder failure is an error; its fallback line is still spoken in the same response.
    failed = server(t, said.Error("reply_failed", "timeout", {"reply_id": "r3", "failure": "first_token_timeout"}))
    assert types(failed) == ["error"] and failed[0]["voicebot"] == {"reply_id": "r3", "failure": "first_token_timeout"}


def test_events_voicebot_has_and_realtime_does_not_are_dropped():
    t = translator()
    assert server(t, said.Pong(1)) == [] and server(t, said.StateReset("periodic", 1, [], [])) == []
    assert t.server_event(AudioFrame(bytes(9600))) == []  # not between audio.start and its end


# ---- push-to-talk, beta-shaped updates ----------------------------------------------------------

def push_to_talk() -> RealtimeTranslator:
    t = translator()
    client(t, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    client(t, {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\0\0" * 24000).decode()})
    return t


def utterance(t: RealtimeTranslator, text: str) -> list[dict]:
    """What the session sends for a committed utterance: its start, its final, its turn's end."""
    return server(t, said.SpeechStarted("u1")) + server(t, final(text)) + server(t, turn_end(text, "input.end"))


def test_response_create_right_after_a_commit_waits_for_the_commits_turn():
    # Push-to-talk clients send commit and response.create together; the create must not be
    # refused because the utterance is still being recognised, nor overtake `committed`.
    t = push_to_talk()
    assert commands(client(t, {"type": "input_audio_buffer.commit"})) == [EndInput(type="input.end")]
    assert client(t, {"type": "response.create", "event_id": "c1"}) == []
    events = utterance(t, "hello there")
    assert "error" not in types(events) and "input_audio_buffer.committed" in types(events)
    # The reply that follows is that create's; a second create has nothing new.
    assert error_of(client(t, {"type": "response.create"}))["code"] == "response_create_nothing_new"


def test_a_held_response_create_whose_commit_held_no_words_gets_its_error_after_committed():
    t = push_to_talk()
    client(t, {"type": "input_audio_buffer.commit"})
    client(t, {"type": "response.create", "event_id": "c1"})
    events = utterance(t, "")
    assert types(events)[-1] == "error" and types(events).index("input_audio_buffer.committed") < len(events) - 1
    assert events[-1]["error"]["code"] == "response_create_nothing_new" and events[-1]["error"]["event_id"] == "c1"


def test_no_speech_started_or_stopped_with_turn_detection_off():
    t = push_to_talk()
    client(t, {"type": "input_audio_buffer.commit"})
    events = utterance(t, "hi")
    assert "input_audio_buffer.speech_started" not in types(events)
    assert "input_audio_buffer.speech_stopped" not in types(events)
    assert types(events)[0] == "input_audio_buffer.committed"


@pytest.mark.parametrize("beta, param, code", [
    ({"modalities": ["text"]}, "session.modalities", "unsupported_value"),
    ({"voice": "alloy"}, "session.audio.output.voice", "invalid_value"),
    ({"output_audio_format": "g711_ulaw"}, "session.output_audio_format", "unsupported_value"),
    ({"input_audio_format": "g711_alaw"}, "session.input_audio_format", "unsupported_value"),
    ({"temperature": 0.8}, "session.temperature", "unknown_parameter"),
    ({"max_output_tokens": 200}, "session.max_output_tokens", "unsupported_value"),
    ({"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, "session.audio.input.noise_reduction", "unsupported_value"),
    ({"turn_detection": {"type": "server_vad", "prefix_padding_ms": 500}}, "session.audio.input.turn_detection.prefix_padding_ms",
     "unsupported_value"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 6000}}}},
     "session.audio.input.turn_detection.idle_timeout_ms", "unsupported_value"),
])
def test_beta_and_unserved_session_fields_are_refused_by_name(beta, param, code):
    t = translator()
    before = t.session()
    error = error_of(client(t, {"type": "session.update", "session": {"instructions": "x", **beta}}))
    assert (error["param"], error["code"]) == (param, code) and error["message"]
    assert t.session() == before


def test_beta_session_fields_are_mapped_to_what_they_stand_for():
    t = translator()
    actions = client(t, {"type": "session.update", "session": {
        "modalities": ["text", "audio"], "voice": "zh", "input_audio_format": "pcm16", "output_audio_format": "pcm16",
        "turn_detection": {"type": "server_vad", "silence_duration_ms": 800, "threshold": 0.6},
        "input_audio_transcription": {"model": "whisper-1", "language": "zh"}}})
    update = commands(actions)[-1]
    assert update.voice == "zh" and update.endpointing.endpoint_silence_ms == 800 and update.language == "zh"
    assert SetVadThreshold(0.6) in actions
    session = t.session()
    assert session["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 800
    assert session["audio"]["input"]["transcription"]["language"] == "zh"
    # The session a client was given, sent back as it is, changes nothing and is not refused.
    assert not any(isinstance(a, Send) for a in client(t, {"type": "session.update", "session": t.session()}))


class TextSink:
    """The socket as RealtimeFrontEnd uses it: send_text only."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))


def test_the_front_end_counts_one_client_event_once_with_all_its_audio():
    async def scenario():
        sink, session, metrics = TextSink(), RecordingSession(), Metrics()
        front_end = RealtimeFrontEnd(sink, translator(), metrics)
        pcm = bytes(CHUNK_BYTES + 100)
        await front_end.on_message(session, json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
        await front_end.on_message(session, b"\x00\x00")  # not part of the protocol: answered, counted
        await front_end.on_message(session, json.dumps({"type": "response.create"}))  # nothing new: answered here
        return sink.sent, session, metrics

    sent, session, metrics = asyncio.run(scenario())
    assert session.arrivals == [CHUNK_BYTES + 100, 0, 0]
    assert [len(c.pcm) for c in session.commands] == [CHUNK_BYTES, 100]
    assert [e["error"]["code"] for e in sent] == ["invalid_event", "response_create_nothing_new"]
    assert metrics.errors.labels("invalid_event")._value.get() == 1
