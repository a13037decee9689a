"""A hypothesis fuzzer of /v1/realtime's client events against the real server on 127.0.0.1.

The same harness as tests/integration/test_fuzz.py (one connection per example, messages sent as fast as they
go, a documented close after an `error` event or a live session at the end, no handler that died,
/healthz still up), with OpenAI Realtime client events: every event type the adapter serves with
fuzzed fields, the beta API's session fields, base64 audio valid or not, unknown types, the hostile
frames of tests/hostile.py, random text and binary frames. Alive means both halves answer: the
adapter (an unknown event gets its `error` with the event's `event_id`) and the session behind it
(a `session.update` gets its `session.updated`). Bounded: 60 examples of at most 20 messages.
"""

from __future__ import annotations

import base64
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hostile import HOSTILE_TEXT
from tests.integration.test_fuzz import FUZZ, MAX_MESSAGES, fuzzed_server, json_values, run_example  # noqa: F401 (the fixture)

audio = st.one_of(
    st.binary(max_size=4800).map(lambda pcm: base64.b64encode(pcm).decode()),  # up to 100 ms, odd lengths too
    st.integers(0, 60_000).map(lambda n: base64.b64encode(bytes(n)).decode()),  # silence, past the 64 KiB frame too
    st.text(max_size=20),  # not base64
)
turn_detection = st.none() | st.fixed_dictionaries({"type": st.sampled_from(["server_vad", "semantic_vad", "dance"])}, optional={
    "threshold": st.floats(-1, 2) | json_values,
    "silence_duration_ms": st.integers(0, 9000) | json_values,
    "create_response": st.booleans(),
    "interrupt_response": st.booleans(),
    "eagerness": st.sampled_from(["low", "auto", "high"]),
})
session = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["realtime", "transcription"]) | json_values,
    "instructions": st.text(max_size=40) | json_values,
    "output_modalities": st.sampled_from([["audio"], ["text"], []]) | json_values,
    "audio": st.fixed_dictionaries({}, optional={
        "input": st.fixed_dictionaries({}, optional={
            "format": st.sampled_from([{"type": "audio/pcm", "rate": 24000}, {"type": "audio/pcmu"}]) | json_values,
            "turn_detection": turn_detection | json_values,
            "transcription": st.none() | st.fixed_dictionaries({}, optional={"language": st.sampled_from(["en", "zh", ""]) | json_values}),
            "noise_reduction": st.none() | json_values,
        }),
        "output": st.fixed_dictionaries({}, optional={
            "voice": st.sampled_from(["en", "zh", "alloy"]) | json_values,
            "speed": st.sampled_from([1.0, 1.5]) | json_values,
        }),
    }) | json_values,
    # the beta API's shape
    "modalities": st.sampled_from([["text", "audio"], ["text"]]) | json_values,
    "voice": st.sampled_from(["en", "alloy"]) | json_values,
    "input_audio_format": st.sampled_from(["pcm16", "g711_ulaw"]) | json_values,
    "output_audio_format": st.sampled_from(["pcm16", "g711_alaw"]) | json_values,
    "turn_detection": turn_detection | json_values,
    "temperature": st.floats(0, 2),
    "tools": st.sampled_from([[], [{"type": "function", "name": "f"}]]),
})
item = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call"]) | json_values,
    "role": st.sampled_from(["user", "assistant", "system"]) | json_values,
    "id": st.text(max_size=10) | json_values,
    "content": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "input_audio"])},
                                              optional={"text": st.text(max_size=30) | json_values}), max_size=3) | json_values,
})


def client_event(kind: str, **fields: st.SearchStrategy) -> st.SearchStrategy[str]:
    """A client event of `kind` with some of `fields` and maybe an event_id."""
    fields["event_id"] = st.text(max_size=12) | json_values
    return st.fixed_dictionaries({}, optional=fields).map(lambda f: json.dumps({"type": kind, **f}))


realtime_event = st.one_of(
    client_event("session.update", session=session | json_values),
    client_event("input_audio_buffer.append", audio=audio | json_values),
    client_event("input_audio_buffer.append", audio=audio),
    client_event("input_audio_buffer.commit"),
    client_event("input_audio_buffer.clear"),
    client_event("conversation.item.create", item=item | json_values),
    client_event("conversation.item.truncate", item_id=st.sampled_from(["item_x", ""]) | json_values,
                 content_index=st.integers(-1, 2) | json_values, audio_end_ms=st.integers(-5, 10**7) | json_values),
    client_event("response.create", response=json_values),
    client_event("response.cancel"),
    client_event("output_audio_buffer.clear"),
    client_event("dance"),
)
realtime_messages = st.lists(st.one_of(realtime_event, realtime_event, realtime_event, st.sampled_from(HOSTILE_TEXT),
                                       st.text(max_size=40), st.binary(max_size=200)), max_size=MAX_MESSAGES)


async def realtime_alive(ws, wait_event) -> None:
    await ws.send(json.dumps({"type": "alive.check", "event_id": "alive"}))
    await wait_event(lambda e: e.get("type") == "error" and e["error"].get("event_id") == "alive", "error for alive.check")
    await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "alive"}}))
    await wait_event(lambda e: e.get("type") == "session.updated" and e["session"]["instructions"] == "alive", "session.updated")


@settings(FUZZ, max_examples=60)
@given(messages=realtime_messages)
def test_fuzz_realtime(fuzzed_server, messages):  # noqa: F811 (the fixture, imported)
    run_example(fuzzed_server, "/v1/realtime?model=fuzz", messages, realtime_alive)
