import json

import pytest

from voicebot import protocol
from voicebot.protocol import ErrorCode, ProtocolError


@pytest.mark.parametrize(
    "raw, code",
    [
        ("{not json", ErrorCode.INVALID_JSON),
        ("[1, 2]", ErrorCode.INVALID_MESSAGE),
        ('{"type": "dance"}', ErrorCode.UNKNOWN_TYPE),
        ("{}", ErrorCode.UNKNOWN_TYPE),
        ('{"type": "say"}', ErrorCode.INVALID_MESSAGE),
        ('{"type": "say", "text": 5}', ErrorCode.INVALID_MESSAGE),
        ('{"type": "say", "text": "hi", "volume": 3}', ErrorCode.INVALID_MESSAGE),
        ('{"type": "session.start", "sample_rate": "fast"}', ErrorCode.INVALID_MESSAGE),
        ('{"type": "session.start", "sample_rate": 96000}', ErrorCode.BAD_SAMPLE_RATE),
        ('{"type": "session.start", "sample_rate": 4000}', ErrorCode.BAD_SAMPLE_RATE),
        ('{"type": "session.update", "endpointing": {"endpoint_silence_ms": 5}}', ErrorCode.INVALID_MESSAGE),
    ],
)
def test_bad_text_frames_get_stable_codes(raw, code):
    with pytest.raises(ProtocolError) as exc:
        protocol.parse_text(raw)
    assert exc.value.code == code
    assert exc.value.message


def test_error_message_names_the_field():
    with pytest.raises(ProtocolError) as exc:
        protocol.parse_text('{"type": "say", "text": 5}')
    assert "text" in exc.value.message


def test_valid_messages_parse():
    start = protocol.parse_text(json.dumps({"type": "session.start", "sample_rate": 48000, "voice": "en", "channel": "main"}))
    assert isinstance(start, protocol.SessionStart) and start.sample_rate == 48000 and start.channel == "main"
    say = protocol.parse_text('{"type": "say", "text": "hello", "interrupt": true}')
    assert isinstance(say, protocol.Say) and say.interrupt
    assert isinstance(protocol.parse_text('{"type": "ping", "id": 7}'), protocol.Ping)


@pytest.mark.parametrize(
    "nbytes, rate, code",
    [(3, 16000, ErrorCode.ODD_PCM_BYTES), (32002, 16000, ErrorCode.FRAME_TOO_LARGE), (96002, 48000, ErrorCode.FRAME_TOO_LARGE)],
)
def test_bad_audio_frames(nbytes, rate, code):
    with pytest.raises(ProtocolError) as exc:
        protocol.check_audio(nbytes, rate)
    assert exc.value.code == code


def test_audio_up_to_one_second_is_accepted():
    protocol.check_audio(32000, 16000)
    protocol.check_audio(96000, 48000)
