"""The /v1/voice front end without sockets: its wire to commands, the session's events to its wire."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.frontends.fakes import RecordingSession
from voicebot.frontends.voice import VoiceFrontEnd, listener_wire, parse, payload, wire
from voicebot.messages import AudioFrame
from voicebot.protocol import EndInput, ErrorCode, ProtocolError, Say
from voicebot.session import events
from voicebot.session.commands import AudioChunk


def test_text_frames_are_the_protocols_commands_and_binary_frames_audio():
    assert parse('{"type": "say", "text": "hi"}') == Say(type="say", text="hi")
    assert parse('{"type": "input.end"}') == EndInput(type="input.end")
    assert parse(b"\x01\x00") == AudioChunk(b"\x01\x00")
    with pytest.raises(ProtocolError) as refused:
        parse('{"type": "nope"}')
    assert refused.value.code == ErrorCode.UNKNOWN_TYPE


def test_an_event_is_its_type_then_its_fields_in_declared_order():
    turn = events.TurnEnd("u1", "silence", None, "hello", {"pause_ms": 700})
    assert wire(turn) == ('{"type": "turn.end", "utterance_id": "u1", "by": "silence", "probability": null, '
                          '"text": "hello", "timings": {"pause_ms": 700}}')
    assert wire(events.ReplyDelta("r1", "你好")) == '{"type": "reply.delta", "reply_id": "r1", "text": "你好"}'  # not escaped


def test_flat_fields_sit_at_the_top_where_the_field_stands():
    final = events.AsrFinal("u2", {"text": "hi", "confidence": 0.5, "model": "m", "fallback": None}, 20, {"asr_final_ms": 9})
    assert list(payload(final)) == ["type", "utterance_id", "text", "confidence", "model", "fallback", "gate_muted_ms", "timings"]
    error = events.Error(ErrorCode.BUSY, "full", {"retry_after_s": 1, "overloaded": "vad"})
    assert payload(error) == {"type": "error", "code": "busy", "message": "full", "retry_after_s": 1, "overloaded": "vad"}
    assert list(payload(events.Error("x", "y"))) == ["type", "code", "message"]


def test_audio_is_a_binary_frame_and_listeners_never_get_the_speakers_identity():
    frame = AudioFrame(b"\x00\x01" * 4)
    assert wire(frame) == listener_wire(frame) == frame.pcm
    ready = events.SessionReady("s1", "secret", 1, 16000, 24000, 200, "en", "echo", False)
    mine, theirs = json.loads(wire(ready)), json.loads(listener_wire(ready))
    assert mine["session_id"] == "s1" and mine["resume_token"] == "secret"
    assert theirs == {k: v for k, v in mine.items() if k not in ("session_id", "resume_token")}
    delta = events.ReplyDelta("r1", "x")
    assert listener_wire(delta) == wire(delta)


def test_every_event_kind_has_one_class():
    kinds = [cls.kind for cls in events.ServerEvent.__args__]
    assert len(kinds) == len(set(kinds))


def test_the_front_end_counts_each_message_then_hands_its_command_or_refuses_it():
    async def scenario(session: RecordingSession) -> list[dict]:
        front_end = VoiceFrontEnd(ws=None)  # no socket: on_message never sends
        for message in ('{"type": "say", "text": "hi"}', b"\x00\x00" * 10, '{"type": "say"}'):
            await front_end.on_message(session, message)
        out = []
        while not session.outbox.empty():
            out.append(payload(await session.outbox.get()))
        return out

    session = RecordingSession()
    told = asyncio.run(scenario(session))
    assert session.arrivals == [0, 20, 0]  # every message counted, with its audio
    assert session.commands == [Say(type="say", text="hi"), AudioChunk(b"\x00\x00" * 10)]
    assert [e["code"] for e in told] == [ErrorCode.INVALID_MESSAGE]  # the bad say, told in order on the outbox

    flooded = RecordingSession(flooding=True)
    assert asyncio.run(scenario(flooded)) == [] and flooded.commands == []  # refused: not parsed, not answered
