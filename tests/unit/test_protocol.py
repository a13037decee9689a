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


# ---- the input policy of every route (load_json): each case once killed a session with 1006 ----


@pytest.mark.parametrize(
    "raw, code",
    [
        ("[" * 3000 + "]" * 3000, ErrorCode.UNSUPPORTED_JSON),  # RecursionError in json.loads
        ('{"type": "ping", "id": ' + "[" * 9 + "]" * 9 + "}", ErrorCode.UNSUPPORTED_JSON),
        ('{"type": "ping", "id": ' + "9" * 5000 + "}", ErrorCode.UNSUPPORTED_JSON),  # int() digit limit
        ('{"type": "ping", "id": 1' + "0" * 40 + ".5}", ErrorCode.UNSUPPORTED_JSON),
        ('{"type": "ping", "id": 1e999}', ErrorCode.UNSUPPORTED_JSON),
        ('{"type": "ping", "id": NaN}', ErrorCode.INVALID_JSON),
        ('{"type": "ping", "id": -Infinity}', ErrorCode.INVALID_JSON),
        ('{"type": "ping", "id": "\\ud800"}', ErrorCode.UNSUPPORTED_JSON),  # echoed in pong: unencodable
        ('{"type": "session.start", "language": "x\\udfff"}', ErrorCode.UNSUPPORTED_JSON),
        ('{"type": "ping", "\\udc00": 1}', ErrorCode.UNSUPPORTED_JSON),
        ('["\\ud83d"]', ErrorCode.UNSUPPORTED_JSON),
        ('{"type": "say", "text": "' + "a" * (protocol.MAX_TEXT_CHARS) + '"}', ErrorCode.FRAME_TOO_LARGE),
    ],
)
def test_hostile_json_gets_a_stable_code(raw, code):
    with pytest.raises(ProtocolError) as exc:
        protocol.load_json(raw)
    assert exc.value.code == code
    assert len(exc.value.message) < 200


def test_nesting_within_the_limit_and_brackets_in_text_are_fine():
    depth = protocol.MAX_JSON_DEPTH
    assert protocol.load_json("[" * depth + "]" * depth) == eval("[" * depth + "]" * depth)
    text = "[[[[[[[[[[ {{{{{{{{{{ \\" + '" ]]]]'
    assert protocol.parse_text(json.dumps({"type": "say", "text": text})).text == text


def test_escaped_surrogate_pairs_are_text():
    say = protocol.parse_text('{"type": "say", "text": "\\ud83d\\ude00 hi"}')
    assert say.text == "\U0001f600 hi"


def test_the_largest_valid_say_fits():
    text = "\U0001f600" * 2000  # max_length, every character escaped as a surrogate pair
    raw = json.dumps({"type": "say", "text": text, "interrupt": False})  # ensure_ascii: 12 chars each
    assert len(raw) <= protocol.MAX_TEXT_CHARS
    assert protocol.parse_text(raw).text == text


@pytest.mark.parametrize(
    "raw",
    [
        '{"type": "say", "text": "hi", "interrupt": "yes"}',
        '{"type": "say", "text": "hi", "interrupt": 1}',
        '{"type": "session.start", "sample_rate": "16000"}',
        '{"type": "session.start", "sample_rate": 16000.0}',
        '{"type": "session.start", "sample_rate": true}',
        '{"type": "session.update", "endpointing": {"endpoint_silence_ms": "600"}}',
        '{"type": "ping", "id": true}',
        '{"type": "ping", "id": 9007199254740992}',  # 2**53: a JavaScript client could not read it back
        '{"type": "ping", "id": {"a": 1}}',
        '{"type": "session.start", "voice": ""}',
        '{"type": "session.start", "voice": "' + "v" * 65 + '"}',
        '{"type": "session.start", "resume": "' + "r" * 129 + '"}',
    ],
)
def test_types_are_strict(raw):
    with pytest.raises(ProtocolError) as exc:
        protocol.parse_text(raw)
    assert exc.value.code == ErrorCode.INVALID_MESSAGE


def test_unknown_type_is_quoted_short():
    with pytest.raises(ProtocolError) as exc:
        protocol.parse_text(json.dumps({"type": "x" * 10000}))
    assert exc.value.code == ErrorCode.UNKNOWN_TYPE and len(exc.value.message) < 200


def test_every_message_that_parses_can_be_echoed():
    """What a session echoes back (ping ids, names) always encodes as UTF-8 JSON."""
    for raw in ['{"type": "ping", "id": "caf\\u00e9 \\ud83d\\ude00"}', '{"type": "ping", "id": -9007199254740991}']:
        ping = protocol.parse_text(raw)
        json.dumps(protocol.event("pong", id=ping.id), ensure_ascii=False).encode("utf-8")


def test_the_largest_valid_messages_fit_the_socket_limit():
    from voicebot.frontends import obs_plugin

    largest_obs = obs_plugin.HEADER.size + 2 * obs_plugin.MAX_NAME_BYTES + int(
        obs_plugin.MAX_CHUNK_SECONDS * obs_plugin.MAX_RATE * obs_plugin.MAX_CHANNELS * 2
    )
    largest_voice = int(protocol.MAX_SAMPLE_RATE * protocol.MAX_CHUNK_SECONDS) * 2
    assert max(largest_obs, largest_voice, protocol.MAX_TEXT_CHARS * 4) * 1.25 <= protocol.MAX_MESSAGE_BYTES
