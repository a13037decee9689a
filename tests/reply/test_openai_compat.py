"""The OpenAI-compatible responder against a real local SSE server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from tests.reply.sse_server import Behaviour, SSEServer
from voicebot.config.engines import OpenAICompatConfig, PersonaConfig
from voicebot.reply.base import ResponderError
from voicebot.reply.openai_compat import OpenAICompatResponder, chat_messages
from voicebot.reply.persona import Personas


def make(sse: SSEServer, personas: Personas | None = None, **overrides) -> OpenAICompatResponder:
    config = dict(base_url=sse.base_url, model="test-model", first_token_timeout_s=2.0, total_timeout_s=10.0,
                  retries=2, retry_backoff_s=0.01)
    responder = OpenAICompatResponder(OpenAICompatConfig(**{**config, **overrides}), personas or Personas(None, {}))
    responder.load()
    return responder


async def collect(responder: OpenAICompatResponder, history=(), text="hi", voice=None) -> list[str]:
    try:
        return [delta async for delta in responder.reply(list(history), text, voice)]
    finally:
        await responder.aclose()


def run(coro):
    return asyncio.run(coro)


def test_streams_content_deltas_and_sends_the_request(sse, monkeypatch):
    monkeypatch.setenv("TEST_LLM_KEY", "sk-local")
    sse.reset(Behaviour(chunks=["Hi", " there", "! How", " are you?"]))
    responder = make(sse, api_key_env="TEST_LLM_KEY", temperature=0.3, max_tokens=50, extra_body={"top_p": 0.9})

    deltas = run(collect(responder, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "c"))

    assert deltas == ["Hi", " there", "! How", " are you?"]
    (request,) = sse.requests
    body = request["body"]
    assert body["model"] == "test-model" and body["stream"] is True
    assert (body["temperature"], body["max_tokens"], body["top_p"]) == (0.3, 50, 0.9)
    assert body["messages"] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert request["headers"]["authorization"] == "Bearer sk-local"


def test_a_missing_api_key_variable_fails_at_load(sse, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(ValueError, match="NO_SUCH_KEY_VAR"):
        make(sse, api_key_env="NO_SUCH_KEY_VAR")


def test_persona_per_voice(sse, tmp_path):
    (tmp_path / "host.txt").write_text("You are Mo, the show's host.\n", encoding="utf-8")
    personas = Personas(PersonaConfig(file=tmp_path / "host.txt"), {"yue": PersonaConfig(text="你係阿明。")})
    run(collect(make(sse, personas), voice="en"))
    run(collect(make(sse, personas), voice="yue"))

    systems = [r["body"]["messages"][0] for r in sse.requests]
    assert systems == [{"role": "system", "content": "You are Mo, the show's host."}, {"role": "system", "content": "你係阿明。"}]


def test_a_missing_persona_file_fails_at_load_naming_the_key(sse, tmp_path):
    with pytest.raises(ValueError, match=r"reply\.voice_personas\.yue\.file"):
        make(sse, Personas(None, {"yue": PersonaConfig(file=tmp_path / "missing.txt")}))


def test_consecutive_same_role_messages_are_merged():
    history = [{"role": "user", "content": "first"}, {"role": "user", "content": "again"}]
    assert chat_messages("sys", history, "third") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first\nagain\nthird"},
    ]


def test_a_system_message_heading_the_history_replaces_the_persona():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    assert chat_messages("You are Mo.", history, "again") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "again"},
    ]


def test_slow_first_token_is_retried_then_fails_with_first_token_timeout(sse):
    sse.reset(default=Behaviour(first_delay_s=5))
    responder = make(sse, first_token_timeout_s=0.3, retries=1)

    with pytest.raises(ResponderError) as failure:
        run(collect(responder))

    assert failure.value.kind == "first_token_timeout"
    assert len(sse.requests) == 2  # the first attempt and one retry


def test_a_retry_recovers_before_the_first_token(sse):
    sse.reset(Behaviour(status=503), Behaviour(malformed_at=0), Behaviour(chunks=["Fine", "."]))
    assert run(collect(make(sse, retries=2))) == ["Fine", "."]
    assert len(sse.requests) == 3


def test_client_errors_are_not_retried(sse):
    sse.reset(default=Behaviour(status=401))
    with pytest.raises(ResponderError, match="401") as failure:
        run(collect(make(sse)))
    assert failure.value.kind == "status"
    assert len(sse.requests) == 1


def test_a_connection_dropped_after_the_first_token_is_not_retried(sse):
    sse.reset(default=Behaviour(chunks=["One", " two", " three"], drop_after=2))
    received: list[str] = []

    async def consume() -> None:
        responder = make(sse)
        try:
            async for delta in responder.reply([], "count"):
                received.append(delta)
        finally:
            await responder.aclose()

    with pytest.raises(ResponderError) as failure:
        run(consume())
    assert failure.value.kind == "dropped"
    assert received == ["One", " two"]
    assert len(sse.requests) == 1


def test_a_stream_that_ends_without_finishing_is_dropped(sse):
    sse.reset(default=Behaviour(done=False))
    with pytest.raises(ResponderError) as failure:
        run(collect(make(sse, retries=0)))
    assert failure.value.kind == "dropped"


def test_a_malformed_chunk_fails(sse):
    sse.reset(default=Behaviour(chunks=["a", "b"], malformed_at=1))
    with pytest.raises(ResponderError, match="not JSON") as failure:
        run(collect(make(sse)))
    assert failure.value.kind == "malformed"


def test_unreachable_endpoint_is_a_connect_failure(sse):
    closed = SSEServer()
    closed.close_unstarted()  # nothing accepts on its port
    with pytest.raises(ResponderError) as failure:
        run(collect(make(closed, retries=1)))
    assert failure.value.kind == "connect"


def test_total_timeout_bounds_a_slow_stream(sse):
    sse.reset(default=Behaviour(chunks=["x"] * 100, interval_s=0.05))
    with pytest.raises(ResponderError) as failure:
        run(collect(make(sse, total_timeout_s=0.5)))
    assert failure.value.kind == "total_timeout"
    assert len(sse.requests) == 1


def test_closing_the_reply_closes_the_http_stream_at_once(sse):
    sse.reset(default=Behaviour(chunks=[f" w{i}" for i in range(1000)], interval_s=0.01))

    async def consume_some() -> tuple[int, int]:
        responder = make(sse)
        reply = responder.reply([], "talk")
        received = 0
        async for _ in reply:
            received += 1
            if received == 20:
                break
        sent_at_close = sse.sent
        await reply.aclose()
        await asyncio.to_thread(sse.stream_closed.wait, 5)
        await responder.aclose()
        return sent_at_close, received

    sent_at_close, received = run(consume_some())
    assert sse.stream_closed.is_set()
    # The server stopped within a few chunks of the close (those already on their way).
    assert sse.sent - sent_at_close <= 5
    assert sse.sent < 100


def test_a_leading_think_block_is_not_spoken(sse):
    sse.reset(Behaviour(chunks=["<th", "ink>\nThe user", " greets me. </thi", "nk>\n\n", "Hello", " you."]),
              Behaviour(chunks=["<b>", "bold</b>"]), Behaviour(chunks=["<thi"]))
    assert "".join(run(collect(make(sse)))) == "Hello you."
    assert "".join(run(collect(make(sse)))) == "<b>bold</b>"
    assert "".join(run(collect(make(sse)))) == "<thi"


def test_thinking_past_the_first_token_deadline_is_a_first_token_timeout(sse):
    sse.reset(default=Behaviour(chunks=["<think>", "hmm"] + [" hmm"] * 100, interval_s=0.02))
    with pytest.raises(ResponderError) as failure:
        run(collect(make(sse, first_token_timeout_s=0.5, retries=0)))
    assert failure.value.kind == "first_token_timeout"
