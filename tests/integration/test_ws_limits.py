"""What the WebSocket routes refuse, cut and hand over, and that they say so: the real server on
127.0.0.1, real sockets.

Oversized binary frames get the `frame_too_large` error the protocol promises, not a flooding
close; a /funasr file larger than the flood guard's audio allowance may be sent in one message; a
`say` past reply.max_reply_chars is cut and the client told what was cut; a session whose resume
token another client used loses the conversation instead of feeding it.
"""

from __future__ import annotations

import asyncio
import json

import websockets

from tests.conftest import TEST_PHRASES, VoiceClient, speech_pcm


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_a_binary_frame_over_the_frame_limit_is_refused_and_the_session_goes_on(server):
    dropped_before = server.metric("voicebot_input_dropped_seconds_total", 'reason="frame_too_large"')

    async def scenario():
        async with VoiceClient.connect(server.ws_url, sample_rate=16000) as client:
            await client.ws.send(bytes(300_000))  # ~9.4 s at 16 kHz: past the frame limit and the flood guard's 8 s
            error = await client.wait_for("error")
            await client.send({"type": "ping", "id": "still-there"})
            await client.wait_for("pong")
            return error, client.ws.close_code

    error, close_code = run(scenario())
    assert error["code"] == "frame_too_large" and "32000 bytes" in error["message"] and close_code is None
    dropped = server.metric("voicebot_input_dropped_seconds_total", 'reason="frame_too_large"') - dropped_before
    assert dropped == 300_000 / 32000


def test_repeated_oversized_frames_still_flood(server):
    async def scenario():
        async with VoiceClient.connect(server.ws_url, sample_rate=16000) as client:
            try:
                for _ in range(50):
                    await client.ws.send(bytes(300_000))
                await client.ws.wait_closed()
            except websockets.ConnectionClosed:
                pass
            return client.ws.close_code

    assert run(scenario()) == 4008


def test_a_funasr_file_bigger_than_the_audio_allowance_in_one_message_is_answered(server):
    # 3 MB in one message: over the flood guard's 68 s of PCM (2.2 MB), under the 64 MiB file limit.
    # Not a real file: the answer is the decode error, with the is_end the runtime's client waits for.
    async def scenario():
        async with websockets.connect(server.ws_url.replace("/v1/voice", "/funasr"), max_size=None) as ws:
            await ws.send(json.dumps({"mode": "offline", "wav_name": "big", "wav_format": "others", "is_speaking": True}))
            await ws.send(b"\x01\x02" * 1_500_000)
            await ws.send(json.dumps({"is_speaking": False, "is_end": True}))
            return json.loads(await asyncio.wait_for(ws.recv(), 30)), ws.close_code

    answer, close_code = run(scenario())
    assert answer["is_end"] and answer["is_final"] and answer["text"].startswith("ERROR.") and "others" in answer["error"]
    assert close_code is None


def test_a_resumed_conversation_belongs_to_the_new_session_only(server):
    # Someone else resumes with this session's token while it is still connected (a stolen token):
    # the old session is told, goes on with a new conversation, and nothing it hears reaches the thief's.
    phrase = TEST_PHRASES[0]

    async def scenario():
        async with VoiceClient.connect(server.ws_url) as owner:
            token = owner.of_type("session.ready")[0]["resume_token"]
            async with VoiceClient.connect(server.ws_url, resume=token) as thief:
                assert thief.of_type("session.ready")[0]["resumed"]
                lost = await owner.wait_for("error", code="conversation_lost")
                await owner.stream(speech_pcm(phrase), speed=2)
                await owner.wait_for("reply.done")
                owner_id = owner.of_type("session.ready")[0]["session_id"]
                thief_id = thief.of_type("session.ready")[0]["session_id"]
                sessions = server.runtime.sessions
                owner_history = server.on_loop(lambda: sessions[owner_id].conversation.messages())
                thief_history = server.on_loop(lambda: sessions[thief_id].conversation.messages())
                return lost, owner_history, thief_history

    lost, owner_history, thief_history = run(scenario())
    assert "resume token" in lost["message"]
    assert owner_history[0] == {"role": "user", "content": phrase}
    assert thief_history == []


def test_a_say_past_the_reply_limit_is_cut_and_the_client_told_what(server):
    limit = server.settings.reply.max_reply_chars
    text = " ".join(["hello there"] * (limit // 11 + 20))
    cut_before = server.metric("voicebot_errors_total", 'code="reply_cut"')

    async def scenario():
        async with VoiceClient.connect(server.ws_url) as client:
            await client.send({"type": "say", "text": text})
            done = await client.wait_for("reply.done")
            await client.send({"type": "interrupt"})
            return done, client.of_type("error")

    done, errors = run(scenario())
    (cut,) = errors
    assert cut["code"] == "reply_cut" and cut["reply_id"] == done["reply_id"]
    assert done["text"] + cut["cut_text"] == text and cut["cut_chars"] == len(text) - len(done["text"]) > 0
    assert server.metric("voicebot_errors_total", 'code="reply_cut"') == cut_before + 1


def test_an_invalid_utf8_text_frame_closes_1007_with_one_log_line_and_others_go_on(server):
    # RFC 6455 8.1: the connection fails (the websockets library closes it 1007); the server logs
    # one line for it, not a traceback per frame, and the next session is served.
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("uvicorn.error").addHandler(handler)

    async def scenario():
        async with VoiceClient.connect(server.ws_url) as client:
            client.ws.protocol.send_text(b"\xff\xfe not utf-8")
            client.ws.send_data()
            await client.ws.wait_closed()
            closed = client.ws.close_code
        async with VoiceClient.connect(server.ws_url) as client:
            await client.send({"type": "ping", "id": "next"})
            await client.wait_for("pong")
        return closed

    try:
        assert run(scenario()) == 1007
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    (line,) = [r for r in records if "UTF-8" in r.getMessage()]
    assert line.exc_info is None and line.levelname == "WARNING"
