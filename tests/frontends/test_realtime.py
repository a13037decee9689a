"""/v1/realtime with the official openai SDK, unmodified, as the client, against the real server.

The SDK builds its URL from base_url (http://127.0.0.1:PORT/v1 -> ws://127.0.0.1:PORT/v1/realtime
?model=...) and sends the API key as `Authorization: Bearer`. Speech is espeak's at 24 kHz
(tests/conftest.py); pocketsphinx with the test phrase grammar transcribes it and the echo
responder answers with what it heard, so every transcript is known.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from typing import Any

from openai import AsyncOpenAI

from tests.conftest import TEST_PHRASES, RunningServer, speech_pcm
from voicebot.frontends.realtime_events import RealtimeTranslator
from voicebot.session import events as said
from voicebot.session.commands import ClearInput

RATE = 24000
CHUNK_BYTES = RATE // 10 * 2  # 100 ms of pcm16


class Recorder:
    """Reads every server event off an SDK connection; `wait` returns them as dicts."""

    def __init__(self, connection) -> None:
        self.connection = connection
        self.events: list[dict] = []
        self._new = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(Exception):
            async for event in self.connection:  # the SDK's own parsing of each event
                self.events.append(event.to_dict())
                self._new.set()

    def of_type(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    async def wait(self, kind: str, count: int = 1, timeout: float = 20, **match: Any) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.of_type(kind) if all(e.get(k) == v for k, v in match.items())]
            if len(found) >= count:
                return found[count - 1]
            if (remaining := deadline - time.monotonic()) <= 0:
                raise AssertionError(f"no {count} x {kind} {match} in {timeout} s; got {[e['type'] for e in self.events]}")
            self._new.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._new.wait(), remaining)

    def audio(self, response_id: str) -> bytes:
        return b"".join(base64.b64decode(e["delta"]) for e in self.of_type("response.output_audio.delta")
                        if e["response_id"] == response_id)

    def close(self) -> None:
        self._reader.cancel()


@contextlib.asynccontextmanager
async def realtime(server: RunningServer):
    client = AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="unused-without-a-server-token")
    async with client.realtime.connect(model="voicebot-test") as connection:
        recorder = Recorder(connection)
        try:
            await recorder.wait("session.created")
            yield connection, recorder
        finally:
            recorder.close()


async def append_speech(connection, pcm: bytes, speed: float = 2.0) -> None:
    for i in range(0, len(pcm), CHUNK_BYTES):
        await connection.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + CHUNK_BYTES]).decode())
        await asyncio.sleep(0.1 / speed)


def history(server: RunningServer, recorder: Recorder) -> list[dict]:
    session_id = recorder.of_type("session.created")[0]["session"]["id"].removeprefix("sess_")
    return server.on_loop(lambda: server.runtime.sessions[session_id].conversation.messages())


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_a_spoken_question_gets_its_transcript_and_a_spoken_reply(server):
    phrase = TEST_PHRASES[2]

    async def scenario():
        async with realtime(server) as (connection, events):
            created = events.of_type("session.created")[0]["session"]
            assert created["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": RATE}
            await connection.session.update(session={
                "type": "realtime", "instructions": "You are Mo, a cheerful co-host.",
                "audio": {"input": {"transcription": {"model": "any", "language": "en"},
                                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 500, "threshold": 0.5}},
                          "output": {"voice": "en"}}})
            updated = (await events.wait("session.updated"))["session"]
            assert updated["instructions"] == "You are Mo, a cheerful co-host." and updated["audio"]["output"]["voice"] == "en"
            await append_speech(connection, speech_pcm(phrase, rate=RATE))
            started = await events.wait("input_audio_buffer.speech_started")
            completed = await events.wait("conversation.item.input_audio_transcription.completed")
            assert completed["transcript"] == phrase and completed["item_id"] == started["item_id"]
            assert completed["voicebot"]["model"].startswith("pocketsphinx") and "confidence" in completed["voicebot"]  # None: pocketsphinx has none
            assert events.of_type("input_audio_buffer.committed")[0]["item_id"] == started["item_id"]
            done = (await events.wait("response.done"))["response"]
            assert done["status"] == "completed"
            transcript = "".join(e["delta"] for e in events.of_type("response.output_audio_transcript.delta"))
            assert transcript == phrase  # the echo responder
            assert events.of_type("response.created")[0]["response"]["id"] == done["id"]
            assert len(events.audio(done["id"])) / 2 / RATE > 1.0  # seconds of 24 kHz speech
            assert history(server, events) == [{"role": "user", "content": phrase}, {"role": "assistant", "content": phrase}]
            assert server.on_loop(lambda: next(iter(server.runtime.sessions.values())).conversation.instructions) == \
                "You are Mo, a cheerful co-host."

    run(scenario())


# A typed message (any text: the grammar constrains only speech) whose echo lasts about 8 s, so that
# a loaded machine still cuts it while it plays.
LONG_TEXT = " and ".join([TEST_PHRASES[1]] * 3)


def test_cancel_and_truncate_keep_only_what_was_heard(server):
    text = LONG_TEXT

    async def scenario():
        async with realtime(server) as (connection, events):
            await connection.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
            await events.wait("conversation.item.added")
            await connection.response.create()
            created = (await events.wait("response.created"))["response"]
            await events.wait("response.output_audio.delta", count=7)  # 1.4 s of the reply's audio
            await connection.response.cancel()
            done = (await events.wait("response.done"))["response"]
            assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
            assert done["voicebot"]["frames_dropped"] >= 0 and done["voicebot"]["heard_text"]
            item_id = events.of_type("response.output_item.added")[0]["item"]["id"]
            await connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=1000)
            truncated = await events.wait("conversation.item.truncated")
            heard = truncated["voicebot"]["heard_text"]
            assert truncated["item_id"] == item_id and truncated["audio_end_ms"] == 1000
            assert heard and text.startswith(heard) and heard != text  # words of the first second only
            assert history(server, events) == [{"role": "user", "content": text}, {"role": "assistant", "content": heard}]
            assert created["id"] == done["id"]

    run(scenario())


def test_speech_over_the_reply_cancels_it_and_the_history_keeps_what_was_heard(server):
    question, interruption = LONG_TEXT, TEST_PHRASES[3]

    async def scenario():
        async with realtime(server) as (connection, events):
            await connection.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]})
            await connection.response.create()
            await events.wait("response.output_audio.delta", count=3)
            await append_speech(connection, speech_pcm(interruption, rate=RATE, lead_s=0.1))
            cut = (await events.wait("response.done"))["response"]
            assert cut["status"] == "cancelled" and cut["status_details"]["reason"] == "turn_detected"
            heard = cut["voicebot"]["heard_text"]
            assert question.startswith(heard) and heard != question
            completed = await events.wait("conversation.item.input_audio_transcription.completed")
            assert completed["transcript"] == interruption
            answer = (await events.wait("response.done", count=2))["response"]
            assert answer["status"] == "completed"
            expected = [{"role": "user", "content": question}] + ([{"role": "assistant", "content": heard}] if heard else [])
            assert history(server, events) == expected + [{"role": "user", "content": interruption},
                                                          {"role": "assistant", "content": interruption}]

    run(scenario())


def test_bad_events_get_openai_errors_and_the_session_goes_on(server):
    async def scenario():
        async with realtime(server) as (connection, events):
            await connection.send_raw("{not json")
            await connection.send_raw('{"type": "bogus.event", "event_id": "e1"}')
            await connection.send_raw('{"type": "input_audio_buffer.append", "audio": "***"}')
            await connection.session.update(session={"type": "realtime", "audio": {"output": {"voice": "no-such-voice"}}})
            await connection.response.cancel()  # nothing to cancel
            await events.wait("error", count=5)
            errors = [e["error"] for e in events.of_type("error")]
            assert [e["code"] for e in errors] == ["invalid_json", "unknown_event_type", "invalid_value", "invalid_value",
                                                   "response_cancel_not_active"]
            assert all(e["type"] == "invalid_request_error" and e["message"] for e in errors)
            assert errors[1]["event_id"] == "e1" and errors[3]["param"] == "session.audio.output.voice"
            # Still serving: a typed message is answered.
            await connection.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "stop talking now"}]})
            await connection.response.create()
            done = (await events.wait("response.done"))["response"]
            assert done["status"] == "completed" and events.audio(done["id"])
            assert server.metric("voicebot_errors_total", 'code="unknown_event_type"') >= 1

    run(scenario())


def test_events_the_adapter_answers_itself_count_for_the_flood_guard(server):
    async def scenario():
        async with realtime(server) as (connection, events):
            for _ in range(1000):  # far over limits.max_messages_per_s, each answered with an error
                with contextlib.suppress(Exception):  # the server closes the connection part way
                    await connection.send_raw('{"type": "response.cancel"}')
            deadline = time.monotonic() + 10
            while not any(e["error"]["code"] == "flooding" for e in events.of_type("error")) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            codes = {e["error"]["code"] for e in events.of_type("error")}
            assert codes == {"response_cancel_not_active", "flooding"}, codes

    run(scenario())


def test_manual_commit_without_turn_detection(server):
    phrase = TEST_PHRASES[0]

    async def scenario():
        async with realtime(server) as (connection, events):
            await connection.input_audio_buffer.commit()  # nothing appended yet
            assert (await events.wait("error"))["error"]["code"] == "input_audio_buffer_commit_empty"
            await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            assert (await events.wait("session.updated"))["session"]["audio"]["input"]["turn_detection"] is None
            await append_speech(connection, speech_pcm(phrase, rate=RATE, tail_s=0.6), speed=3)
            await asyncio.sleep(0.3)
            assert not events.of_type("input_audio_buffer.committed")  # no VAD commit without turn detection
            # Push-to-talk: the commit and the response.create at once, as clients send them.
            await connection.input_audio_buffer.commit()
            await connection.response.create()  # voicebot answers the committed turn: this asks for that reply
            committed = await events.wait("input_audio_buffer.committed")
            completed = await events.wait("conversation.item.input_audio_transcription.completed")
            assert completed["transcript"] == phrase and completed["item_id"] == committed["item_id"]
            done = (await events.wait("response.done"))["response"]
            assert done["status"] == "completed" and len(events.of_type("response.created")) == 1
            kinds = [e["type"] for e in events.events]
            assert kinds.count("error") == 1  # the empty commit's, before the update: none for the create
            # VAD off: no speech_started/stopped (OpenAI sends none without turn detection)
            assert not {"input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"} & set(kinds)

    run(scenario())


def test_beta_shaped_session_fields_are_applied_or_refused_by_name(server):
    async def scenario():
        async with realtime(server) as (connection, events):
            # The beta API's shape, as older clients send it: what is served is applied...
            await connection.send_raw(json.dumps({"type": "session.update", "session": {
                "modalities": ["text", "audio"], "voice": "en", "output_audio_format": "pcm16",
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 700}}}))
            updated = (await events.wait("session.updated"))["session"]
            assert updated["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 700
            assert updated["voicebot"]["endpoint_silence_ms"] == 700
            # ... and what is not is refused by name, the session unchanged.
            for field, value in (("voice", "alloy"), ("output_audio_format", "g711_ulaw"), ("modalities", ["text"])):
                await connection.send_raw(json.dumps({"type": "session.update", "event_id": field,
                                                      "session": {field: value}}))
            await events.wait("error", count=3)
            errors = {e["error"]["event_id"]: e["error"] for e in events.of_type("error")}
            assert errors["voice"]["param"] == "session.audio.output.voice" and "alloy" in errors["voice"]["message"]
            assert errors["output_audio_format"]["code"] == "unsupported_value"
            assert errors["modalities"]["param"] == "session.modalities"
            assert len(events.of_type("session.updated")) == 1

    run(scenario())


def test_a_truncate_while_the_reply_plays_reports_what_was_played(server):
    async def scenario():
        async with realtime(server) as (connection, events):
            await connection.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": LONG_TEXT}]})
            await connection.response.create()
            await events.wait("response.output_audio.delta", count=10)  # 2 s of the reply's audio
            item_id = events.of_type("response.output_item.added")[0]["item"]["id"]
            await connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=1000)
            truncated = await events.wait("conversation.item.truncated")
            done = (await events.wait("response.done"))["response"]
            heard = truncated["voicebot"]["heard_text"]
            assert heard and LONG_TEXT.startswith(heard) and heard != LONG_TEXT
            # response.done says what the conversation keeps: what was played, not what was sent
            assert done["status"] == "cancelled" and done["voicebot"]["heard_text"] == heard
            assert done["voicebot"]["played_ms"] == 1000
            assert history(server, events)[-1] == {"role": "assistant", "content": heard}

    run(scenario())


def test_clear_mid_utterance_drops_it_and_the_next_one_is_heard(server):
    lost, kept = TEST_PHRASES[1], TEST_PHRASES[3]
    cleared_before = server.metric("voicebot_input_dropped_seconds_total", 'reason="cleared"')

    async def scenario():
        async with realtime(server) as (connection, events):
            pcm = speech_pcm(lost, rate=RATE)
            sent = 0
            for sent in range(0, len(pcm), CHUNK_BYTES):  # until the server hears the speech start
                await connection.input_audio_buffer.append(audio=base64.b64encode(pcm[sent : sent + CHUNK_BYTES]).decode())
                await asyncio.sleep(0.05)
                if events.of_type("input_audio_buffer.speech_started"):
                    break
            assert events.of_type("input_audio_buffer.speech_started") and sent < len(pcm) // 2
            await connection.input_audio_buffer.clear()
            await events.wait("input_audio_buffer.cleared")
            await append_speech(connection, bytes(RATE * 2 * 2), speed=4)  # 2 s of silence: the cut speech would end
            await asyncio.sleep(0.5)
            after_clear = [e["type"] for e in events.events]
            await append_speech(connection, speech_pcm(kept, rate=RATE), speed=4)
            completed = await events.wait("conversation.item.input_audio_transcription.completed")
            done = (await events.wait("response.done"))["response"]
            return after_clear, completed, done, history(server, events)

    after_clear, completed, done, messages = run(scenario())
    assert "error" not in after_clear
    assert not {"input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed",
                "response.created"} & set(after_clear)
    assert completed["transcript"] == kept and done["status"] == "completed"
    assert messages == [{"role": "user", "content": kept}, {"role": "assistant", "content": kept}]
    # At least the speech the endpointer needs before it calls an utterance started was dropped.
    min_speech_s = server.settings.endpoint.min_speech_ms / 1000
    assert server.metric("voicebot_input_dropped_seconds_total", 'reason="cleared"') >= cleared_before + min_speech_s


async def append_until(connection, events: Recorder, pcm: bytes, kind: str, count: int) -> int:
    """Append `pcm` until the `count`-th `kind` event has come; the bytes sent."""
    for sent in range(0, len(pcm), CHUNK_BYTES):
        await connection.input_audio_buffer.append(audio=base64.b64encode(pcm[sent : sent + CHUNK_BYTES]).decode())
        await asyncio.sleep(0.05)
        if len(events.of_type(kind)) >= count:
            return sent + CHUNK_BYTES
    return len(pcm)


def test_a_clear_after_a_commit_leaves_the_item_and_its_turn_to_be_answered():
    """The translator alone: under semantic_vad a committed utterance stays an item through a clear;
    the turn it opened, answered by voicebot, is what the next response.create asks for."""
    t = RealtimeTranslator("gpt-realtime", ["en"])

    def server(event) -> list[str]:
        return [e["type"] for e in t.server_event(event)]

    def client(kind: str, **fields) -> list:
        return t.client_event(json.dumps({"type": kind, **fields}))

    server(said.SessionReady("s", "token", 1, 24000, 24000, 200, "en", "echo", False))
    update = client("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}})
    assert update[-1].endpointing.model_dump(exclude_none=True) == {"turn": "smart"}
    server(said.SpeechStarted("u1"))
    hello = {"text": "hello", "confidence": None, "model": "m", "fallback": None}
    assert "input_audio_buffer.committed" in server(said.AsrFinal("u1", hello, 0, {}))
    server(said.SpeechStarted("u2"))
    assert client("input_audio_buffer.clear") == [ClearInput()]
    assert server(said.InputCleared("u2")) == ["input_audio_buffer.cleared"]  # nothing of u1 retracted
    assert server(said.TurnEnd("u2", "silence", None, "hello", {})) == []
    assert client("response.create") == []  # the reply to the kept turn is on its way: nothing to refuse


def test_clear_in_an_open_smart_turn_drops_only_the_uncommitted_utterance():
    """OpenAI's clear discards the input audio buffer; audio the server already committed is an item,
    no longer in it. Under semantic_vad (smart) each utterance is committed at its pause, before the
    end of the turn is decided: a clear then drops only the utterance in progress, and the turn's
    committed utterances are answered when it ends (docs/realtime.md)."""
    from tests.conftest import make_settings, running_server

    kept, lost = TEST_PHRASES[1], TEST_PHRASES[3]

    async def scenario(server):
        async with realtime(server) as (connection, events):
            await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}})
            assert (await events.wait("session.updated"))["session"]["voicebot"]["turn"] == "smart"
            # The first utterance, its pause, and the second one up to its start: one turn, still open.
            first = speech_pcm(kept, rate=RATE)
            second = speech_pcm(lost, rate=RATE)
            await append_speech(connection, first)
            sent = await append_until(connection, events, second, "input_audio_buffer.speech_started", count=2)
            assert len(events.of_type("input_audio_buffer.speech_started")) == 2 and sent < len(second) // 2
            committed = await events.wait("input_audio_buffer.committed")
            assert not events.of_type("response.created")  # the turn is not decided yet
            await connection.input_audio_buffer.clear()
            await events.wait("input_audio_buffer.cleared")
            await append_speech(connection, bytes(RATE * 2 * 3), speed=4)  # 3 s of silence: past smart_limit_ms
            done = (await events.wait("response.done"))["response"]
            return events, committed, done, history(server, events)

    settings = make_settings(endpoint={"turn": "smart", "smart_threshold": 0.999, "smart_threshold_floor": 0.999,
                                       "smart_words_go": 0.0, "smart_limit_ms": 2000})
    with running_server(settings) as server:
        cleared_before = server.metric("voicebot_input_dropped_seconds_total", 'reason="cleared"')
        ends_before = server.metric("voicebot_turn_ends_total", 'by="silence"')
        events, committed, done, messages = run(scenario(server))
        cleared = server.metric("voicebot_input_dropped_seconds_total", 'reason="cleared"') - cleared_before
        ends = server.metric("voicebot_turn_ends_total", 'by="silence"') - ends_before
    second_item = events.of_type("input_audio_buffer.speech_started")[1]["item_id"]
    assert [e["item_id"] for e in events.of_type("input_audio_buffer.committed")] == [committed["item_id"]] != [second_item]
    assert [e["transcript"] for e in events.of_type("conversation.item.input_audio_transcription.completed")] == [kept]
    assert done["status"] == "completed" and len(events.of_type("response.created")) == 1
    assert "".join(e["delta"] for e in events.of_type("response.output_audio_transcript.delta")) == kept
    assert messages == [{"role": "user", "content": kept}, {"role": "assistant", "content": kept}]
    assert ends == 1  # the kept turn ended at the silence limit, as an open turn does
    assert cleared >= server.settings.endpoint.min_speech_ms / 1000  # what was heard of the cleared one
    assert not events.of_type("error")


def test_realtime_sessions_and_audio_requests_share_max_sessions():
    import httpx
    import openai

    from tests.conftest import make_settings, running_server

    async def scenario(server):
        client = AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="k", max_retries=0)
        async with client.realtime.connect(model="m") as first:
            assert (await first.recv()).type == "session.created"
            async with client.realtime.connect(model="m") as second:
                event = (await second.recv()).to_dict()
                assert event["type"] == "error" and event["error"]["code"] == "busy" and event["error"]["type"] == "server_error"
                assert event["voicebot"]["retry_after_s"] == 5
            try:
                await client.audio.speech.create(model="tts-1", voice="en", input="hello")
                raise AssertionError("a speech request was served past max_sessions")
            except openai.APIStatusError as refused:
                assert refused.status_code == 503 and refused.body["code"] == "busy"
                assert refused.response.headers["retry-after"] == "5"
        # A speech stream holds its place while it runs: minutes of speech, more than the socket's
        # buffers hold, so it is still running while this client reads nothing; then the client leaves.
        long_text = ". ".join([TEST_PHRASES[1]] * 100)[:4000]
        async with httpx.AsyncClient(base_url=server.http_url, timeout=10) as http:
            async with http.stream("POST", "/v1/audio/speech", json={"model": "m", "voice": "en", "input": long_text}) as speech:
                assert speech.status_code == 200 and server.metric("voicebot_audio_api_active") == 1
                async with client.realtime.connect(model="m") as third:
                    assert (await third.recv()).to_dict()["error"]["code"] == "busy"
        deadline = time.monotonic() + 5
        while server.metric("voicebot_audio_api_active") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert server.metric("voicebot_audio_api_active") == 0
        assert server.metric("voicebot_audio_api_requests_total", 'outcome="busy",route="speech"') == 1
        assert server.metric("voicebot_audio_api_requests_total", 'outcome="client_gone",route="speech"') == 1

    with running_server(make_settings(server={"max_sessions": 1})) as server:
        run(scenario(server))
