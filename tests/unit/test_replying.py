"""The replying stage alone: a 60 s reply plays to its end (every frame, then audio.end) whether
synthesis runs ahead of playback or behind it, on an event loop whose clock jumps over waits."""

from __future__ import annotations

import asyncio
import selectors
from typing import AsyncIterator

import numpy as np
import pytest

from voicebot.audio.rates import SPEAK_RATE
from voicebot.audio.resample import float_to_pcm16
from voicebot.config.engines import ReplyConfig
from voicebot.config.stages import PacingConfig
from voicebot.engine_reports import ResetReport
from voicebot.frontends.voice import payload
from voicebot.messages import AudioFrame, Turn
from voicebot.metrics import Metrics
from voicebot.reply.history import Conversation
from voicebot.reply.repeat import RepeatResponder
from voicebot.reply.safety import SpeechFilter
from voicebot.session.events import AudioEnd
from voicebot.session.outbox import Outbox
from voicebot.session.replying import FRAMES_MAX, Replying
from voicebot.tts.base import SpeechChunk, SynthesisContext

REPLY_S = 60.0
CHUNK_S = 0.5


class _JumpingSelector(selectors.DefaultSelector):
    """Polls the real sockets; when none is ready, moves the loop's clock to its next timer."""

    def __init__(self, loop: "VirtualTimeLoop") -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if not ready:
            if timeout is None:
                raise RuntimeError("every task waits and no timer is set: the reply is stuck")
            self._loop.now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """asyncio.sleep and loop.time() run on a clock that advances only while every task waits."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


class ToneSynthesis(SynthesisContext):
    """REPLY_S of a known signal in CHUNK_S chunks; each chunk takes `realtime_factor` x its length."""

    voice = "test"

    def __init__(self, realtime_factor: float) -> None:
        self.realtime_factor = realtime_factor
        t = np.arange(int(REPLY_S * SPEAK_RATE)) / SPEAK_RATE
        self.audio = (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)

    async def stream(self, text: AsyncIterator[str]) -> AsyncIterator[SpeechChunk]:
        words = "".join([delta async for delta in text])
        step = int(CHUNK_S * SPEAK_RATE)
        for start in range(0, len(self.audio), step):
            await asyncio.sleep(CHUNK_S * self.realtime_factor)
            yield SpeechChunk(self.audio[start : start + step], words, 0)

    def set_voice(self, voice: str) -> None:
        pass

    async def reset(self) -> ResetReport:
        return ResetReport("tone", 0, 0)

    async def close(self) -> None:
        pass


def play_reply(realtime_factor: float) -> tuple[list[bytes], list[dict], float, Conversation, Metrics, ToneSynthesis]:
    loop = VirtualTimeLoop()
    metrics, conversation, tts = Metrics(), Conversation(8), ToneSynthesis(realtime_factor)

    async def scenario():
        outbox = Outbox(metrics)
        stage = Replying(tts, conversation, outbox, metrics, SpeechFilter([]), ReplyConfig(), PacingConfig(),
                         clock=loop.time)
        reply = stage.reply(Turn("tell me a long story", say=False), "echo", RepeatResponder(), on_speaking=lambda: None)
        player = asyncio.create_task(reply.run())
        frames, events = [], []
        while not any(e["type"] == "audio.end" for e in events):
            message = await asyncio.wait_for(outbox.get(), 10)  # virtual seconds
            if isinstance(message, AudioFrame):
                frames.append(message.pcm)
            else:
                events.append(payload(message))  # as /v1/voice writes it
        await player
        return frames, events, loop.time()

    try:
        frames, events, elapsed = loop.run_until_complete(scenario())
    finally:
        loop.close()
    return frames, events, elapsed, conversation, metrics, tts


@pytest.mark.parametrize("realtime_factor", [0.05, 1.25], ids=["synthesis-ahead", "synthesis-behind"])
def test_a_60_s_reply_plays_every_frame_to_audio_end(realtime_factor):
    frames, events, elapsed, conversation, metrics, tts = play_reply(realtime_factor)
    expected = float_to_pcm16(tts.audio)
    assert b"".join(frames) == expected  # every frame, in order, nothing cut
    end = events[-1]
    assert end["type"] == "audio.end" and end["frames"] == len(frames) == int(REPLY_S * 1000 / 200)
    assert end["samples"] == len(tts.audio)
    kinds = [e["type"] for e in events]
    assert kinds[-3:] == ["reply.done", "audio.start", "audio.end"] and set(kinds[:-3]) == {"reply.delta"}
    assert metrics.frames_dropped.labels("interrupted")._value.get() == 0
    assert conversation.messages()[-1] == {"role": "assistant", "content": "tell me a long story"}
    if realtime_factor < 1:
        # Synthesis ran ahead, held back by the frame queue: paced playback, no underrun.
        assert end["timings"]["underruns"] == 0 and REPLY_S - 1 < elapsed < REPLY_S + 1
        assert len(frames) > FRAMES_MAX  # the queue filled and drained more than once
    else:
        # Synthesis behind real time: the client ran dry and the reply still ended whole.
        assert end["timings"]["underruns"] > 0 and elapsed >= REPLY_S * realtime_factor


def test_a_started_reply_holds_its_audio_until_play_and_a_cancel_counts_it():
    loop = VirtualTimeLoop()
    metrics, tts = Metrics(), ToneSynthesis(0.05)

    async def scenario():
        outbox = Outbox(metrics)
        stage = Replying(tts, Conversation(8), outbox, metrics, SpeechFilter([]), ReplyConfig(), PacingConfig(),
                         clock=loop.time)
        reply = stage.reply(Turn("hello there", say=True), "echo", RepeatResponder(), on_speaking=lambda: None)
        reply.start()
        await asyncio.sleep(30)  # virtual: the producer fills the holding buffer and waits
        held = reply.frames.qsize()
        await reply.cancel("turn_changed")
        sent = []
        while not sent or sent[-1] != "audio.interrupted":
            message = await asyncio.wait_for(outbox.get(), 1)
            sent.append("frame" if isinstance(message, AudioFrame) else message.kind)
        return reply, held, sent

    try:
        reply, held, sent = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert held == FRAMES_MAX and reply.frames_produced > FRAMES_MAX  # and more waiting for room
    assert "frame" not in sent and "audio.start" not in sent
    # Every frame produced is counted as dropped, those waiting for room too, plus the framer's partial one.
    assert metrics.frames_dropped.labels("interrupted")._value.get() == reply.frames_produced + 1


class RecordingEcho(RepeatResponder):
    """The echo responder, keeping the history each reply was asked with."""

    def __init__(self) -> None:
        self.histories: list[list[dict]] = []

    async def reply(self, history, text, voice=None):
        self.histories.append(history)
        async for delta in super().reply(history, text, voice):
            yield delta


def test_the_clients_instructions_lead_the_history_and_a_truncate_keeps_what_was_played():
    loop = VirtualTimeLoop()
    metrics, conversation, responder = Metrics(), Conversation(8), RecordingEcho()
    conversation.instructions = "Be brief."
    conversation.add_user("earlier")
    conversation.add_assistant("reply")

    async def scenario():
        outbox = Outbox(metrics)
        stage = Replying(ToneSynthesis(0.05), conversation, outbox, metrics, SpeechFilter([]), ReplyConfig(),
                         PacingConfig(), clock=loop.time)
        reply = stage.reply(Turn("tell me a long story", say=False), "echo", responder, on_speaking=lambda: None)
        player = asyncio.create_task(reply.run())
        while not isinstance(await outbox.get(), AudioEnd):
            pass  # the whole reply is sent (virtual time)
        await player
        return reply.truncate(REPLY_S * 1000 / 2)  # but the client played only half of the 60 s

    try:
        heard = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert responder.histories == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "earlier"},
                                    {"role": "assistant", "content": "reply"}]]
    assert heard == "tell me a"  # half of the one segment's words, cut at a word
    assert conversation.messages()[-2:] == [{"role": "user", "content": "tell me a long story"},
                                            {"role": "assistant", "content": "tell me a"}]
