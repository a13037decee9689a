"""The Realtime session object: what session.update may change here, checked in full before any of
it is taken, and the beta API's shape mapped to the GA fields it stands for. No I/O, no state: the
translator (realtime_events.py) keeps what is in force and applies a `SessionChange`."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

INPUT_RATE = 24000  # the only input rate of the Realtime protocol's audio/pcm
PCM_FORMAT = {"type": "audio/pcm", "rate": INPUT_RATE}
# Range of the session's endpoint_silence_ms (voicebot.protocol.EndpointingUpdate).
SILENCE_MS = (100, 5000)
# turn_detection null (manual commits): the VAD still cuts an utterance, after this much silence.
MANUAL_SILENCE_MS = SILENCE_MS[1]
DEFAULT_TURN_DETECTION = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
                          "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}


class RealtimeError(Exception):
    """A client event refused; the connection goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


@dataclass(frozen=True)
class SessionChange:
    """A session.update, checked: what is in force once it is taken (None: unchanged)."""

    instructions: str | None
    voice: str | None
    turn_detection: dict | None  # None: manual commits
    transcription: dict | None  # None: no transcripts


def parse_update(update: dict, in_force: dict, voices: Collection[str]) -> SessionChange:
    """Check a session.update's `session` against what is in force (`in_force`, the session object
    last reported); raise RealtimeError, naming the field, for the first thing it cannot take."""
    session = ga_shaped(update)
    if session.get("type", "realtime") != "realtime":
        raise RealtimeError("only realtime sessions are served here (not transcription)", param="session.type")
    if session.get("output_modalities") not in (None, ["audio"]):
        raise RealtimeError("output_modalities must be [\"audio\"]: voicebot always speaks its replies",
                            "unsupported_value", "session.output_modalities")
    if session.get("tools"):
        raise RealtimeError("tools are not supported", "unsupported_value", "session.tools")
    audio = object_at(session, "audio", "session.audio", required=False)
    audio_in = object_at(audio, "input", "session.audio.input", required=False)
    audio_out = object_at(audio, "output", "session.audio.output", required=False)
    for where, config in (("input", audio_in), ("output", audio_out)):
        if "format" in config and config["format"] != PCM_FORMAT and config["format"] != {"type": "audio/pcm"}:
            raise RealtimeError(f"audio {where} format must be {json.dumps(PCM_FORMAT)}", "unsupported_value",
                                f"session.audio.{where}.format")
    if audio_out.get("speed", 1.0) != 1.0:
        raise RealtimeError("speed is not supported", "unsupported_value", "session.audio.output.speed")
    _only_in_force(session, in_force, _SESSION_FIELDS, "session")
    _only_in_force(audio_in, in_force["audio"]["input"], ("format", "turn_detection", "transcription"), "session.audio.input")
    _only_in_force(audio_out, in_force["audio"]["output"], ("format", "voice", "speed"), "session.audio.output")
    voice = audio_out.get("voice")
    if voice is not None and (not isinstance(voice, str) or voice not in voices):
        raise RealtimeError(f"unknown voice {str(voice)[:64]!r}; available: {', '.join(voices)}", param="session.audio.output.voice")
    instructions = session.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RealtimeError("instructions must be a string", param="session.instructions")
    current = in_force["audio"]["input"]
    turn_detection = _turn_detection(audio_in["turn_detection"]) if "turn_detection" in audio_in else current["turn_detection"]
    transcription = _transcription(audio_in["transcription"]) if "transcription" in audio_in else current["transcription"]
    return SessionChange(instructions, voice, turn_detection, transcription)


def ga_shaped(session: dict) -> dict:
    """A session.update in the beta API's shape (`modalities`, `voice`, `input_audio_format`,
    `output_audio_format`, `turn_detection`, `input_audio_transcription` at the top) mapped to
    the GA fields it stands for; what has no GA field here is refused by the checks that follow."""
    session = dict(session)
    audio = dict(object_at(session, "audio", "session.audio", required=False))
    audio_in = dict(object_at(audio, "input", "session.audio.input", required=False))
    audio_out = dict(object_at(audio, "output", "session.audio.output", required=False))
    for beta, (where, name) in _BETA_FIELDS.items():
        if beta not in session:
            continue
        value = session.pop(beta)
        target = {"session": session, "input": audio_in, "output": audio_out}[where]
        if beta == "modalities":
            if not isinstance(value, list) or "audio" not in value:
                raise RealtimeError("modalities must include \"audio\": voicebot always speaks its replies (their "
                                    "transcript comes with the audio)", "unsupported_value", "session.modalities")
            value = ["audio"]
        elif beta.endswith("_audio_format"):
            if value != "pcm16":
                raise RealtimeError(f"{beta} {str(value)[:32]!r} is not served: audio is pcm16 at 24 kHz "
                                    f"({json.dumps(PCM_FORMAT)})", "unsupported_value", f"session.{beta}")
            value = PCM_FORMAT
        if name in target and target[name] != value:
            raise RealtimeError(f"session.{beta} and its GA field disagree: send one", param=f"session.{beta}")
        target[name] = value
    if audio_in:
        audio["input"] = audio_in
    if audio_out:
        audio["output"] = audio_out
    if audio:
        session["audio"] = audio
    return session


# The beta API's session fields: where each goes in the GA shape (session, audio.input or audio.output).
_BETA_FIELDS = {
    "modalities": ("session", "output_modalities"),
    "voice": ("output", "voice"),
    "input_audio_format": ("input", "format"),
    "output_audio_format": ("output", "format"),
    "turn_detection": ("input", "turn_detection"),
    "input_audio_transcription": ("input", "transcription"),
}
# The session fields session.update applies or checks itself; any other is taken only with the
# value in force (a client may send back the session it was given), else refused by name.
_SESSION_FIELDS = ("type", "instructions", "audio", "output_modalities", "tools")


def _only_in_force(update: dict, in_force: dict, handled: Collection[str], param: str) -> None:
    """Refuse every field of `update` not in `handled` whose value is not the one in force: a field
    this server cannot apply is never dropped unsaid."""
    for name, value in update.items():
        if name in handled:
            continue
        if name not in in_force:
            raise RealtimeError(f"{param}.{name[:64]} is not a setting here (settings: {', '.join(sorted(in_force))})",
                                "unknown_parameter", f"{param}.{name[:64]}")
        if value != in_force[name]:
            raise RealtimeError(f"{param}.{name} cannot be changed here; in force: {json.dumps(in_force[name])[:200]}",
                                "unsupported_value", f"{param}.{name}")


def object_at(parent: dict, key: str, param: str, required: bool = True) -> dict:
    """`parent[key]`, which must be an object (absent: {} unless `required`)."""
    value = parent.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise RealtimeError(f"{param} must be an object", param=param)
    return value


def _turn_detection(value: Any) -> dict | None:
    """A client's turn_detection, completed with the defaults; None: manual commits."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("server_vad", "semantic_vad"):
        raise RealtimeError("turn_detection must be null or of type server_vad or semantic_vad",
                            param="session.audio.input.turn_detection")
    param = "session.audio.input.turn_detection"
    for flag in ("create_response", "interrupt_response"):
        if value.get(flag) is False:
            raise RealtimeError(f"{flag}: false is not supported: voicebot answers every turn and yields to the user",
                                "unsupported_value", f"{param}.{flag}")
    if value["type"] == "semantic_vad":
        return {"type": "semantic_vad", "eagerness": value.get("eagerness", "auto"), "create_response": True,
                "interrupt_response": True}
    # Not applied here (the endpointer keeps its own pre-roll; an idle turn is the client's to end):
    # taken only as they are in force, as session.update takes every field it cannot apply.
    for name in ("prefix_padding_ms", "idle_timeout_ms"):
        if value.get(name, DEFAULT_TURN_DETECTION[name]) != DEFAULT_TURN_DETECTION[name]:
            raise RealtimeError(f"{name} cannot be changed here; in force: {json.dumps(DEFAULT_TURN_DETECTION[name])}",
                                "unsupported_value", f"{param}.{name}")
    detection = {**DEFAULT_TURN_DETECTION, **{k: v for k, v in value.items() if k in DEFAULT_TURN_DETECTION and v is not None}}
    silence = detection["silence_duration_ms"]
    if not isinstance(silence, int) or isinstance(silence, bool) or not SILENCE_MS[0] <= silence <= SILENCE_MS[1]:
        raise RealtimeError(f"silence_duration_ms must be an integer in {SILENCE_MS[0]}-{SILENCE_MS[1]}",
                            param=f"{param}.silence_duration_ms")
    threshold = detection["threshold"]
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 < threshold < 1:
        raise RealtimeError("threshold must be a number between 0 and 1", param=f"{param}.threshold")
    return detection


def _transcription(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RealtimeError("transcription must be null or an object", param="session.audio.input.transcription")
    language = value.get("language")
    if language is not None and (not isinstance(language, str) or not 1 <= len(language) <= 64):
        raise RealtimeError("language must be a name of 1-64 characters", param="session.audio.input.transcription.language")
    # The model is the server's recognizer, whatever the client names; the prompt is not used.
    return {"model": value.get("model") or "voicebot", "language": language, "prompt": value.get("prompt")}


def session_object(session_id: str | None, model: str, instructions: str, transcription: dict | None,
                   turn_detection: dict | None, voice: str | None, in_force: dict) -> dict:
    """The session object of session.created and session.updated: what is in force. `in_force`:
    what decides a turn here, as voicebot reported it (`turn` smart or silence: silence where the
    end-of-turn model did not load)."""
    return {
        "type": "realtime", "object": "realtime.session", "id": f"sess_{session_id}", "model": model,
        "output_modalities": ["audio"], "instructions": instructions, "tools": [], "tool_choice": "auto",
        "max_output_tokens": "inf", "tracing": None, "prompt": None, "expires_at": 0, "include": None,
        "audio": {
            "input": {"format": PCM_FORMAT, "transcription": transcription, "noise_reduction": None,
                      "turn_detection": turn_detection},
            "output": {"format": PCM_FORMAT, "voice": voice, "speed": 1.0},
        },
        "voicebot": in_force or None,
    }


def endpointing(turn_detection: dict | None) -> dict:
    """A turn_detection as the session's endpointing (voicebot.protocol.EndpointingUpdate's fields)."""
    if turn_detection is None:
        return {"turn": "silence", "endpoint_silence_ms": MANUAL_SILENCE_MS}
    if turn_detection["type"] == "semantic_vad":
        return {"turn": "smart"}
    return {"turn": "silence", "endpoint_silence_ms": turn_detection["silence_duration_ms"]}


def decode_audio(event: dict) -> bytes:
    """input_audio_buffer.append's audio: base64 pcm16 at 24 kHz, an even number of bytes."""
    audio = event.get("audio")
    if not isinstance(audio, str):
        raise RealtimeError("audio must be a base64 string of pcm16 at 24 kHz", param="audio")
    try:
        pcm = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError("audio is not valid base64", param="audio") from None
    if len(pcm) % 2:
        raise RealtimeError(f"audio holds {len(pcm)} bytes; pcm16 needs an even count", param="audio")
    return pcm
