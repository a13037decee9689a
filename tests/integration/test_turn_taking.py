"""Turn-taking through the real server: what ends a turn, replies prepared during the pause, and
the bot deaf to its own voice. Real espeak speech over real WebSockets, the real Smart Turn model.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.audio import espeak_speech, to_pcm16
from tests.conftest import TEST_PHRASES, VoiceClient, make_settings, running_server, speech_pcm
from tests.reply.sse_server import Behaviour, SSEServer
from voicebot.audio.resample import StreamResampler


@pytest.fixture(scope="module")
def sse():
    server = SSEServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(sse):
    # smart_threshold 0.999: the model never says "complete" in these tests, so each turn ends at the
    # silence limit, whatever the model makes of espeak's prosody: what is tested is the seam.
    settings = make_settings(
        endpoint={"smart_threshold": 0.999, "smart_threshold_floor": 0.999, "smart_words_go": 0.0, "smart_limit_ms": 1200},
        reply={"engine": "openai", "openai": {"base_url": sse.base_url, "model": "test", "first_token_timeout_s": 5.0}},
    )
    with running_server(settings) as running:
        sse.stream_closed.wait(5)  # the warm-up utterance's reply
        yield running


def pause(ms: int) -> np.ndarray:
    return np.zeros(16 * ms, np.float32)


async def turn_of(client: VoiceClient, parts: list[np.ndarray]) -> None:
    audio = np.concatenate([pause(300), *parts, pause(2500)])
    await client.stream(to_pcm16(audio), chunk_ms=20)


def test_readyz_says_what_ends_turns_and_how_echo_is_heard(server):
    ready = server.get("/readyz").json()
    assert ready["turn"] == {"mode": "smart", "configured": "smart", "problem": None}
    assert ready["echo"] == {"problem": None}  # libspeexdsp loaded: the recognizer hears the linear canceller


def test_a_prepared_reply_is_kept_and_sent_at_once(server, sse):
    sse.reset(default=Behaviour(chunks=["Sure", ", the show starts at eight."]))
    kept = server.metric("voicebot_preemptive_total", 'outcome="kept"')

    async def run():
        async with VoiceClient.connect(server.ws_url) as client:
            await turn_of(client, [espeak_speech(TEST_PHRASES[2])])
            end = await client.wait_for("turn.end", timeout=10)
            done = await client.wait_for("audio.end", timeout=20)
            return client, end, done

    client, end, done = asyncio.run(run())
    assert end["by"] == "silence" and end["probability"] < 0.999 and end["text"] == TEST_PHRASES[2]
    assert end["timings"]["pause_ms"] >= 1200
    # The model was asked at the short pause and again as it grew: its last question, timed.
    timings = end["timings"]
    assert timings["asked_ms"] > 0 and timings["queued_ms"] >= 0 and timings["model_ms"] > 0
    assert timings["decision_ms"] is None  # the model did not decide this turn
    assert server.metric("voicebot_preemptive_total", 'outcome="kept"') == kept + 1
    assert len(sse.requests) == 1 and sse.cancelled == 0
    # Prepared during the pause: the first frame follows the decision by the send path alone.
    assert done["timings"]["first_audio_ms"] - end["timings"]["end_of_speech_ms"] < 150
    assert client.of_type("reply.done")[0]["text"] == "Sure, the show starts at eight."


def test_a_prepared_reply_is_discarded_when_the_user_goes_on(server, sse):
    # The first reply (prepared at the pause inside the turn) is slow: still streaming when the user goes on.
    sse.reset(Behaviour(chunks=["first", " reply", " never", " heard"], first_delay_s=0.3, interval_s=0.5),
              default=Behaviour(chunks=["The second reply."]))
    went_on = server.metric("voicebot_preemptive_total", 'outcome="user_went_on"')
    dropped = server.metric("voicebot_frames_dropped_total", 'reason="preemptive"')

    async def run():
        async with VoiceClient.connect(server.ws_url) as client:
            await turn_of(client, [espeak_speech(TEST_PHRASES[3]), pause(800), espeak_speech(TEST_PHRASES[0])])
            await client.wait_for("audio.end", timeout=20)
            return client

    client = asyncio.run(run())
    assert len(sse.requests) == 2 and sse.cancelled == 1  # the first stream closed by the client
    assert server.metric("voicebot_preemptive_total", 'outcome="user_went_on"') == went_on + 1
    assert server.metric("voicebot_frames_dropped_total", 'reason="preemptive"') >= dropped
    # Nothing of the discarded reply reached the client: one reply, one audio stream, its frames only.
    starts = client.of_type("audio.start")
    assert len(starts) == 1 and [e["text"] for e in client.of_type("reply.done")] == ["The second reply."]
    assert not any(e["type"] == "reply.delta" and "never" in e["text"] for e in client.events)
    assert all(reply_id == starts[0]["reply_id"] for reply_id, _ in client.frames)
    # ... nor the conversation: the second request holds the whole turn as one user message.
    messages = sse.requests[1]["body"]["messages"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert users[-1] == f"{TEST_PHRASES[3]} {TEST_PHRASES[0]}"
    assert not any(m["role"] == "assistant" and "never" in m["content"] for m in messages)
    assert client.of_type("turn.end")[0]["text"] == users[-1]


def test_silence_rule_and_input_end(server, sse):
    sse.reset(default=Behaviour(chunks=["Ok."]))

    async def run():
        async with VoiceClient.connect(server.ws_url, endpointing={"turn": "silence"}) as client:
            await client.stream(speech_pcm(TEST_PHRASES[1]), chunk_ms=20)
            by_silence = await client.wait_for("turn.end", timeout=10)
            await client.wait_for("audio.end", timeout=20)
            await client.stream(speech_pcm(TEST_PHRASES[0], tail_s=0.1), chunk_ms=20)
            await client.send({"type": "input.end"})
            by_client = await client.wait_for("turn.end", count=2, timeout=10)
            return by_silence, by_client

    by_silence, by_client = asyncio.run(run())
    assert by_silence["by"] == "silence" and by_silence["probability"] is None
    assert by_silence["timings"]["asked_ms"] is None and by_silence["timings"]["model_ms"] is None
    assert 500 <= by_silence["timings"]["pause_ms"] < 700
    assert by_client["by"] == "input.end"


BARGE_IN_AT_S = 1.5  # into the reply: a cold canceller, in AEC3's first seconds


def echo_case(server, cancel: bool, barge_in: np.ndarray | None = None) -> dict:
    """A question, then the reply's own audio fed back into the input 150 ms late at -10 dB, and
    `barge_in` spoken over it from BARGE_IN_AT_S into the reply. The client plays the reply as the
    protocol says: each frame after the one before it, and on `audio.interrupted` it drops what it
    has not played yet (before, this one played every frame it had received, so up to the pacing
    lead of the bot's voice came back after the cut with no reference to cancel it)."""

    async def run():
        async with VoiceClient.connect(server.ws_url, echo_cancellation=cancel, endpointing={"turn": "silence"}) as client:
            await client.stream(speech_pcm(TEST_PHRASES[1], tail_s=0.6), chunk_ms=20)
            resampler = StreamResampler(24000, 16000)
            unplayed = pause(0)  # received, not yet played
            room = pause(150)  # played, on its way back to the microphone
            sent_frames = 0
            user = barge_in if barge_in is not None else pause(0)
            user_at = None  # the chunk the user starts talking in
            for i in range(int(8 / 0.02)):  # 8 s of "microphone": the reply as the room returns it
                while sent_frames < len(client.frames):
                    pcm = np.frombuffer(client.frames[sent_frames][1], "<i2").astype(np.float32) / 32768
                    unplayed = np.concatenate([unplayed, resampler.process(pcm) * 10 ** (-10 / 20)])
                    sent_frames += 1
                if client.of_type("audio.interrupted"):
                    unplayed = pause(0)
                played, unplayed = np.concatenate([unplayed[:320], pause(20)])[:320], unplayed[320:]
                room = np.concatenate([room, played])
                chunk, room = room[:320], room[320:]
                if user_at is None and client.frames:
                    user_at = i + round(BARGE_IN_AT_S / 0.02)
                if user_at is not None and i >= user_at:
                    said = user[(i - user_at) * 320 : (i - user_at + 1) * 320]
                    chunk = chunk + np.concatenate([said, pause(20)])[:320]
                await client.ws.send(to_pcm16(chunk))
                await asyncio.sleep(0.02)
                user_done = barge_in is None or (user_at is not None and (i - user_at) * 320 >= len(user))
                if (client.of_type("audio.end") or client.of_type("audio.interrupted")) and user_done:
                    break
            if barge_in is not None:
                await client.stream(to_pcm16(pause(1000)), chunk_ms=20)  # the end of the user's turn
            await asyncio.sleep(0.5)
            # What a failure is told (issue 29: a run with three finals was left undiagnosed): the
            # events in order, and the chunk the user started talking in.
            timeline = [(e["type"], e.get("utterance_id"), e.get("text"), e.get("reason")) for e in client.events
                        if e["type"] in ("speech.started", "asr.final", "audio.start", "audio.interrupted", "audio.end")]
            return {"interrupted": client.of_type("audio.interrupted"), "finals": client.of_type("asr.final"),
                    "ended": client.of_type("audio.end"), "timeline": {"user_at_chunk": user_at, "events": timeline}}

    return asyncio.run(run())


def test_the_bot_does_not_hear_itself(server, sse):
    sse.reset(default=Behaviour(chunks=["Here is a long answer that goes on for a while, about the weather ",
                                        "and the show and everything else you might want to know."]))
    without = echo_case(server, cancel=False)
    sse.reset(default=Behaviour(chunks=["Here is a long answer that goes on for a while, about the weather ",
                                        "and the show and everything else you might want to know."]))
    with_aec = echo_case(server, cancel=True)
    print(f"\nwithout cancellation: barge-ins {len(without['interrupted'])}, transcripts {len(without['finals'])}; "
          f"with: barge-ins {len(with_aec['interrupted'])}, transcripts {len(with_aec['finals'])}")
    assert without["interrupted"], "the echo never reached the bot: this test would prove nothing"
    assert not with_aec["interrupted"] and with_aec["ended"]
    assert len(with_aec["finals"]) == 1  # the question only: no transcript of the echo


def barge_in_over_echo(server, sse) -> dict:
    sse.reset(default=Behaviour(chunks=["Here is a long answer that goes on for a while, about the weather ",
                                        "and the show and everything else you might want to know."]))
    return echo_case(server, cancel=True, barge_in=espeak_speech(TEST_PHRASES[2]) * 0.7)


def test_speech_over_the_bots_echo_barges_in(server, sse):
    # The user talks over a reply that is echoing back: the canceller removes the echo, not the
    # user, so the reply is cut by the user (barge_in), and the echo is never transcribed.
    result = barge_in_over_echo(server, sse)
    assert [e["reason"] for e in result["interrupted"]] == ["barge_in"]
    assert len(result["finals"]) == 2, [e["text"] for e in result["finals"]]  # the question, the barge-in


# AEC3's suppressor takes 5-27 dB off each 100 ms of the first 0.6-0.9 s of the words while the
# reply's reference is still fed, and the grammar decoder made '' of that. The recognizer now hears
# the linear canceller's output (voicebot/audio/echo.py), which keeps them. It failed about 1 run in
# 5 on a loaded box (issue 29): AEC3 took the words' first 0.7-1.2 s off the suppressed output the
# VAD hears, the utterance (so the recognizer's audio) started inside the words, and the final was
# ''. The front end now reaches back over what the suppressor left of them (EchoOnset,
# voicebot/audio/echo_onset.py; offline: tests/unit/test_echo.py's 60-260 ms sweep). Still failing in
# 0 of 12 runs alone, 3 of 35 beside one or two busy processes, with three finals: the question, ''
# and ''. The input of two of them, captured and run through a canceller again, did the same offline: a pure
# 215 (154) ms path, the suppressor took ~0.5 s from inside the words, the endpoint rule ended the
# utterance there and began another (test_echo.py's "one utterance" case, 240 and 300 ms). The windows the
# suppressor hid are no longer the user's silence (voicebot/audio/endpoint.py, HELD_SILENCE_SHARE): 0 of 26
# runs failed beside one or two busy processes, against 1 of 26 before, alternated on the same box.
def test_speech_over_the_bots_echo_is_transcribed(server, sse):
    result = barge_in_over_echo(server, sse)
    texts = [e["text"] for e in result["finals"]]
    # the question, the words said over the echo
    assert texts == [TEST_PHRASES[1], TEST_PHRASES[2]], result["timeline"]


def test_obs_audio_cancels_echo_by_default(server):
    import json
    import time

    import websockets

    from voicebot.frontends.obs_plugin import HEADER

    before = set(server.on_loop(lambda: list(server.runtime.sessions)))

    async def run():
        url = f"ws://127.0.0.1:{server.settings.server.port}/obs/audio?channel=echo-test"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "start", "timestamp": 0}))
            await ws.send(HEADER.pack(0, 48000, 1, 16, 0, 0) + bytes(2 * 1024))
            for _ in range(400):  # 20 s: a loaded box may take seconds to start the session
                echo = server.on_loop(lambda: [s.echo is not None for i, s in server.runtime.sessions.items() if i not in before])
                if echo == [True]:  # registered first, its canceller set once session.start is handled
                    return echo
                await asyncio.sleep(0.05)
            return echo

    started = time.monotonic()
    assert asyncio.run(run()) == [True], f"no /obs/audio session with echo cancellation after {time.monotonic() - started:.1f} s"


@pytest.mark.parametrize("turn, limit_ms, tail_s", [
    ("smart", 1200, 0.4),  # a turn open after the short pause, its silence limit never heard
    ("smart", 1200, 0.1),  # the short pause itself never heard: the endpointer still in the utterance
    ("silence", 500, 0.2),  # the silence rule: less tail than endpoint_silence_ms
])
def test_a_turn_ends_when_the_client_stops_sending(server, sse, turn, limit_ms, tail_s):
    """A client that sends its speech and a short tail, then nothing (push-to-talk, a stalled
    uplink): the silence limit runs on the wall clock, so the turn still ends and is answered.
    Before, audio time stood still and the turn stayed open forever (with the silence rule, and
    with a tail shorter than the smart pause, even the endpointer's utterance did)."""
    sse.reset(default=Behaviour(chunks=["Ok."]))

    async def run():
        async with VoiceClient.connect(server.ws_url, endpointing={"turn": turn}) as client:
            await client.stream(speech_pcm(TEST_PHRASES[1], tail_s=tail_s), chunk_ms=20)
            sent = asyncio.get_running_loop().time()
            end = await client.wait_for("turn.end", timeout=10)
            waited = asyncio.get_running_loop().time() - sent
            await client.wait_for("audio.end", timeout=20)
            return end, waited

    end, waited = asyncio.run(run())
    assert end["by"] == "silence" and end["text"] == TEST_PHRASES[1]
    assert end["timings"]["pause_ms"] < limit_ms  # the audio's own silence: the rest was the wall clock's
    assert waited >= limit_ms / 1000 - tail_s  # not before the limit, the whole tail counted as silence
