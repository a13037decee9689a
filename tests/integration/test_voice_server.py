"""The real server on 127.0.0.1, real WebSockets, real (espeak) speech streamed in real time.

Assertions are on counts, order and content, never on wall-clock durations.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import websockets

from tests.conftest import VoiceClient, make_settings, running_server, speech_pcm
from voicebot.protocol import CloseCode

FRAME_BYTES = 9600


def run(coro):
    return asyncio.run(coro)


def check_reply_frames(client: VoiceClient, end: dict) -> list[bytes]:
    frames = client.reply_frames(end["reply_id"])
    assert len(frames) == end["frames"]
    assert all(len(f) == FRAME_BYTES for f in frames[:-1])
    assert 0 < len(frames[-1]) <= FRAME_BYTES and len(frames[-1]) % 2 == 0
    assert sum(len(f) for f in frames) == 2 * end["samples"]
    return frames


def test_conversation_transcripts_reply_frames_and_metrics(server):
    utterances_before = server.metric("voicebot_utterances_total", 'model="pocketsphinx-en-us-grammar"')

    async def talk():
        async with VoiceClient.connect(server.ws_url) as client:
            await client.stream(speech_pcm("hello there how are you"))
            final = await client.wait_for("asr.final")
            end = await client.wait_for("audio.end")
            return client, final, end

    client, final, end = run(talk())
    assert final["text"] == "hello there how are you"
    assert final["model"] == "pocketsphinx-en-us-grammar" and final["fallback"] is None
    partials = client.of_type("asr.partial")
    assert partials and partials[-1]["text"] == final["text"]
    order = [e["type"] for e in client.events]
    assert order.index("speech.started") < order.index("asr.partial") < order.index("asr.final") < order.index("audio.start") < order.index("audio.end")
    assert client.of_type("reply.done")[0]["text"] == "hello there how are you"  # echo
    check_reply_frames(client, end)
    timings = end["timings"]
    assert timings["first_audio_ms"] is not None and timings["first_audio_ms"] > 0
    assert timings["reply_first_text_ms"] is not None and timings["tts_first_audio_ms"] is not None
    assert final["timings"]["endpoint_delay_ms"] > 0
    assert server.metric("voicebot_utterances_total", 'model="pocketsphinx-en-us-grammar"') == utterances_before + 1
    assert server.metric("voicebot_first_audio_seconds_count") >= 1
    assert server.metric("voicebot_frames_dropped_total", 'reason="overload"') == 0


def test_two_sessions_at_once(server):
    async def one(text):
        async with VoiceClient.connect(server.ws_url) as client:
            await client.stream(speech_pcm(text))
            final = await client.wait_for("asr.final")
            end = await client.wait_for("audio.end")
            check_reply_frames(client, end)
            return final["text"]

    async def both():
        return await asyncio.gather(one("hello there how are you"), one("what time does the show start tomorrow"))

    assert run(both()) == ["hello there how are you", "what time does the show start tomorrow"]


def test_bad_input_gets_error_events_and_the_session_goes_on(server):
    async def talk():
        async with VoiceClient.connect(server.ws_url, send_start=False) as client:
            await client.ws.send(b"\x00\x01" * 100)  # audio before session.start
            await client.wait_for("error", code="not_started")
            await client.send({"type": "session.start", "sample_rate": 16000})
            await client.wait_for("session.ready")
            await client.ws.send("{not json")
            await client.send({"type": "dance"})
            await client.send({"type": "say"})
            await client.send({"type": "session.update", "voice": "klingon"})
            await client.ws.send(b"\x00" * 3)
            await client.ws.send(b"\x00" * 40000)
            await client.send({"type": "session.start"})
            for code in ("invalid_json", "unknown_type", "invalid_message", "unknown_voice", "odd_pcm_bytes", "frame_too_large", "already_started"):
                await client.wait_for("error", code=code)
            await client.stream(speech_pcm("stop talking now"))
            return await client.wait_for("asr.final")

    assert run(talk())["text"] == "stop talking now"


def test_input_at_48_khz_is_resampled(server):
    async def talk():
        async with VoiceClient.connect(server.ws_url, sample_rate=48000) as client:
            await client.stream(speech_pcm("please tell me a joke about the weather", rate=48000), rate=48000)
            return await client.wait_for("asr.final")

    assert run(talk())["text"] == "please tell me a joke about the weather"


def test_say_and_session_update(server):
    async def talk():
        async with VoiceClient.connect(server.ws_url) as client:
            await client.send({"type": "session.update", "voice": "zh", "endpointing": {"endpoint_silence_ms": 700}})
            updated = await client.wait_for("session.updated")
            await client.send({"type": "say", "text": "你好，欢迎来到直播间。"})
            end = await client.wait_for("audio.end")
            check_reply_frames(client, end)
            await client.send({"type": "ping", "id": 3})
            pong = await client.wait_for("pong")
            return updated, pong

    updated, pong = run(talk())
    assert updated["voice"] == "zh" and updated["endpoint_silence_ms"] == 700
    assert pong["id"] == 3


def test_barge_in_stops_the_reply_and_trims_history(server):
    long_reply = "please tell me a joke about the weather"

    async def talk():
        async with VoiceClient.connect(server.ws_url) as client:
            # Like a live microphone: silence keeps flowing after the question until the user
            # speaks again, the moment the reply starts.
            question = asyncio.create_task(client.stream(speech_pcm(long_reply, tail_s=5.0)))
            start = await client.wait_for("audio.start")
            question.cancel()
            await client.stream(speech_pcm("stop talking now", lead_s=0.0))
            interrupted = await client.wait_for("audio.interrupted")
            frames_at_interrupt = len(client.reply_frames(start["reply_id"]))
            await client.wait_for("asr.final", count=2)
            await client.wait_for("audio.end")  # the reply to "stop talking now"
            session_id = client.of_type("session.ready")[0]["session_id"]
            history = server.on_loop(lambda: server.runtime.sessions[session_id].conversation.messages())
            return client, start, interrupted, frames_at_interrupt, history

    client, start, interrupted, frames_at_interrupt, history = run(talk())
    assert interrupted["reply_id"] == start["reply_id"] and interrupted["reason"] == "barge_in"
    # Nothing of the interrupted reply arrives after audio.interrupted.
    assert len(client.reply_frames(start["reply_id"])) == frames_at_interrupt == interrupted["frames_sent"]
    assert not [e for e in client.of_type("audio.end") if e["reply_id"] == start["reply_id"]]
    assert interrupted["played_ms"] <= interrupted["frames_sent"] * 200
    heard = history[1]["content"] if len(history) > 1 and history[1]["role"] == "assistant" else ""
    assert history[0] == {"role": "user", "content": long_reply}
    assert heard == interrupted["heard_text"] and long_reply.startswith(heard) and heard != long_reply
    assert server.metric("voicebot_frames_dropped_total", 'reason="interrupted"') >= interrupted["frames_dropped"]


def test_interrupt_message_and_say_with_interrupt(server):
    async def talk():
        async with VoiceClient.connect(server.ws_url) as client:
            await client.send({"type": "say", "text": "This is a long announcement about the schedule of the show tonight and tomorrow."})
            first = await client.wait_for("audio.start")
            await client.send({"type": "say", "text": "Breaking news.", "interrupt": True})
            interrupted = await client.wait_for("audio.interrupted")
            end = await client.wait_for("audio.end")
            await client.send({"type": "interrupt"})  # nothing playing: harmless
            await client.send({"type": "ping"})
            await client.wait_for("pong")
            return first, interrupted, end, client

    first, interrupted, end, client = run(talk())
    assert interrupted["reply_id"] == first["reply_id"] and interrupted["reason"] == "say"
    assert end["reply_id"] != first["reply_id"]
    check_reply_frames(client, end)


def test_periodic_reset_at_turn_boundaries():
    with running_server(make_settings(reset={"interval_s": 2.0})) as srv:
        async def talk():
            async with VoiceClient.connect(srv.ws_url) as client:
                for n, text in enumerate(("hello there how are you", "what time does the show start tomorrow"), start=1):
                    await client.stream(speech_pcm(text, tail_s=1.5))
                    end = await client.wait_for("audio.end", count=n)
                    check_reply_frames(client, end)
                await client.wait_for("state.reset", count=2, timeout=10)
                return client

        client = run(talk())
        resets = client.of_type("state.reset")
        generations = [[e["generation"] for e in r["engines"]] for r in resets]
        assert generations[0] == [1, 1] and generations[1] == [2, 2]
        assert all(r["reason"] == "periodic" and r["duration_ms"] >= 0 for r in resets)
        # A reset never lands inside a reply: between audio.start and its audio.end.
        speaking = False
        for e in client.events:
            if e["type"] == "audio.start":
                speaking = True
            elif e["type"] in ("audio.end", "audio.interrupted"):
                speaking = False
            elif e["type"] == "state.reset":
                assert not speaking
        assert srv.metric("voicebot_resets_total") >= 2


def test_flooding_closes_with_the_documented_code(server):
    async def flood():
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "session.start"}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                for _ in range(5000):
                    await ws.send(json.dumps({"type": "ping"}))
                while True:
                    await ws.recv()
            return closed.value

    closed = run(flood())
    assert closed.rcvd.code == CloseCode.FLOODING and "flooding" in closed.rcvd.reason


def test_audio_flooding_closes_and_counts_the_audio_it_refused(server):
    """Audio far faster than real time: closed as flooding, and the refused audio is counted."""
    before = server.metric("voicebot_input_dropped_seconds_total", 'reason="flooding"')
    second = np.zeros(16000, np.int16).tobytes()  # 1 s at 16 kHz, the largest message allowed

    async def flood():
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "session.start"}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                for _ in range(200):  # 200 s of audio at once
                    await ws.send(second)
                while True:
                    await ws.recv()
            return closed.value

    closed = run(flood())
    assert closed.rcvd.code == CloseCode.FLOODING
    assert server.metric("voicebot_input_dropped_seconds_total", 'reason="flooding"') >= before + 1.0


def test_max_sessions_refuses_the_next_session_and_keeps_the_others():
    with running_server(make_settings(server={"max_sessions": 1})) as srv:
        async def two():
            async with VoiceClient.connect(srv.ws_url) as first:
                async with websockets.connect(srv.ws_url) as ws:
                    refusal = json.loads(await ws.recv())
                    with pytest.raises(websockets.ConnectionClosed) as closed:
                        await ws.recv()
                await first.send({"type": "ping"})
                await first.wait_for("pong")
                return refusal, closed.value.rcvd.code

        refusal, code = run(two())
        assert refusal["code"] == "busy" and refusal["retry_after_s"] > 0
        assert code == CloseCode.TRY_AGAIN_LATER


def test_client_gone_mid_reply_leaves_nothing_behind():
    with running_server(make_settings()) as srv:
        async def leave():
            async with VoiceClient.connect(srv.ws_url) as client:
                await client.send({"type": "say", "text": "A fairly long reply that will be cut off when the listener disappears suddenly."})
                await client.wait_for("audio.start")

        run(leave())
        names = []
        for _ in range(100):
            names = srv.on_loop(lambda: [t.get_name() for t in asyncio.all_tasks() if t.get_name().split("-")[0] in ("listen", "speak", "reset", "reply")])
            if not names and srv.metric("voicebot_active_sessions") == 0:
                break
            run(asyncio.sleep(0.05))
        assert names == []
        assert srv.metric("voicebot_active_sessions") == 0
        assert srv.runtime.sessions == {}
        assert srv.metric("voicebot_frames_dropped_total", 'reason="client_gone"') >= 1


def test_a_reply_longer_than_the_frame_queue_ends_and_the_next_turn_speaks():
    """Synthesis far ahead of playback fills the 10 s frame queue; the end marker must still arrive
    (it was dropped once: no audio.end, every later turn silent)."""
    text = " ".join(["This is a long answer from a chatty character, sentence number %d." % i for i in range(1, 6)])
    assert len(text) > 276

    async def talk():
        async with VoiceClient.connect(server_url) as client:
            await client.send({"type": "say", "text": text})
            end = await client.wait_for("audio.end", timeout=60)
            frames = check_reply_frames(client, end)
            await client.send({"type": "say", "text": "and one more"})
            second = await client.wait_for("audio.end", count=2, timeout=30)
            return frames, end, second

    with running_server(make_settings(pacing={"lead_ms": 5000})) as srv:
        server_url = srv.ws_url
        frames, end, second = run(talk())
        assert end["frames"] > 50  # more than the frame queue holds
        assert second["frames"] >= 1
        assert srv.metric("voicebot_frames_dropped_total", 'reason="interrupted"') == 0
