"""Hostile input for every WebSocket route: the text frames that once killed sessions (issue 12),
and builders of /obs/audio chunks. Used by the fuzzer (tests/integration/test_fuzz.py) and the soak's fuzzing
client (bench/soak.py)."""

from __future__ import annotations

from voicebot.frontends.obs_plugin import HEADER

# Each of these killed a session with 1006 on every route and no error event: RecursionError,
# int()'s digit limit (a ValueError with a traceback), events echoing a lone surrogate that could
# not be encoded, NaN (not JSON), a value that only looks like a bool.
HOSTILE_TEXT = (
    "[" * 3000 + "]" * 3000,
    '{"type": "ping", "id": ' + "[" * 3000 + "]" * 3000 + "}",
    '{"type": "ping", "id": ' + "9" * 5000 + "}",
    '{"type": "session.start", "sample_rate": 1' + "0" * 5000 + "}",
    '{"type": "ping", "id": 1e999}',
    '{"type": "ping", "id": NaN}',
    '{"type": "ping", "id": "\\ud800"}',
    '{"type": "session.start", "language": "\\udfff"}',
    '{"type": "session.update", "language": "\\ud83d"}',
    '{"type": "say", "text": "hi", "interrupt": "yes"}',
    '{"type": "start", "timestamp": ' + "7" * 5000 + "}",  # /obs/audio's control message
    '{"type": "stop", "x": ' + "{" * 3000 + "}" * 3000 + "}",
    '{"mode": "2pass", "wav_name": "\\udc00", "is_speaking": true}',  # /funasr echoes wav_name
    '{"mode": "online", "audio_fs": ' + "1" * 5000 + "}",
    '{"is_speaking": false, "wav_name": "\\ud800\\ud800"}',
    "\x00\x01",
    "",
)

def obs_chunk(pcm: bytes, rate: int = 48000, channels: int = 2, bits: int = 16, source_id: bytes = b"mic",
              source_name: bytes = b"Mic/Aux", timestamp_ns: int = 0) -> bytes:
    """One binary message of the obs-audio-to-websocket plugin (docs/protocol.md)."""
    header = HEADER.pack(timestamp_ns, rate, channels, bits, len(source_id), len(source_name))
    return header + source_id + source_name + pcm
