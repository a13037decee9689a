"""TurnTaking.next_input: when a client that stops sending is taken to be silent (the wall clock);
the early Smart Turn question, on a held model. The end of a turn through the real server is
tests/integration/test_turn_taking.py's."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np

from voicebot.asr.base import Hypothesis
from voicebot.audio.turn import Answer
from voicebot.config.stages import EndpointConfig
from voicebot.messages import AudioIn, InputEnd, Utterance
from voicebot.metrics import Metrics
from voicebot.session.outbox import Outbox
from voicebot.session.turn_taking import STALL_GRACE_S, TurnTaking

RATE = 16000


def turn_taking(in_utterance: bool = True, session_silence_ms: int = 500) -> TurnTaking:
    # The front end as next_input reads it: no silence heard yet; the endpointer waits the
    # session's silence (session.update may set its own), the server's config says 500 ms.
    endpointer = SimpleNamespace(in_utterance=in_utterance, config=EndpointConfig(endpoint_silence_ms=session_silence_ms))
    front_end = SimpleNamespace(resampler=SimpleNamespace(in_rate=RATE), endpointer=endpointer, silence_ms=0.0)
    metrics = Metrics()

    async def queue_turn(turn):
        raise AssertionError("no turn here")

    return TurnTaking(EndpointConfig(turn="silence", endpoint_silence_ms=500), None, front_end, Outbox(metrics), metrics,
                      queue_turn, lambda turn: None)


def chunk(seconds: float) -> AudioIn:
    return AudioIn(bytes(2 * int(RATE * seconds)), time.monotonic())


def test_a_client_that_stops_mid_utterance_gets_an_input_end_after_the_limit():
    async def run():
        tt, queue = turn_taking(), asyncio.Queue()
        await queue.put(chunk(0.02))
        assert isinstance(await tt.next_input(queue), AudioIn)
        started = time.monotonic()
        item = await asyncio.wait_for(tt.next_input(queue), 5)
        return item, time.monotonic() - started, queue.empty()

    item, waited, empty = asyncio.run(run())
    assert isinstance(item, InputEnd) and empty
    assert waited >= 0.5 + STALL_GRACE_S - 0.05  # the whole limit, then the grace


def test_a_client_sending_long_chunks_is_not_stalled_before_its_next_is_due():
    """1 s chunks: the next arrives 1 s after the last, past the 500 ms limit, and is not late."""
    async def run():
        tt, queue = turn_taking(), asyncio.Queue()
        await queue.put(chunk(1.0))
        assert isinstance(await tt.next_input(queue), AudioIn)
        asyncio.get_running_loop().call_later(0.9, queue.put_nowait, chunk(1.0))
        return await asyncio.wait_for(tt.next_input(queue), 5)

    assert isinstance(asyncio.run(run()), AudioIn)


def test_no_deadline_outside_an_utterance():
    async def run():
        tt, queue = turn_taking(in_utterance=False), asyncio.Queue()
        await queue.put(chunk(0.02))
        await tt.next_input(queue)
        try:
            await asyncio.wait_for(tt.next_input(queue), 0.5 + STALL_GRACE_S + 0.3)
        except TimeoutError:
            return "waited"
        return "returned"

    assert asyncio.run(run()) == "waited"


def test_the_sessions_own_silence_rule_is_the_limit_not_the_servers():
    """/v1/realtime's manual commits set a 5 s wait: a client pausing 1 s is not taken as stopped."""
    async def run():
        tt, queue = turn_taking(session_silence_ms=5000), asyncio.Queue()
        await queue.put(chunk(0.02))
        assert isinstance(await tt.next_input(queue), AudioIn)
        asyncio.get_running_loop().call_later(1.0, queue.put_nowait, chunk(0.02))
        return await asyncio.wait_for(tt.next_input(queue), 5)

    assert isinstance(asyncio.run(run()), AudioIn)


class HeldModel:
    """Smart Turn as TurnTaking calls it: each question waits until the test answers it."""

    def __init__(self) -> None:
        self.asked: list[np.ndarray] = []
        self.cancelled = 0
        self.answers: asyncio.Queue[float] = asyncio.Queue()

    async def ask(self, audio: np.ndarray) -> Answer:
        self.asked.append(audio)
        try:
            return Answer(await self.answers.get(), queued_s=0.0, model_s=0.1)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def smart_turn_taking(model: HeldModel, heard: np.ndarray, turns: list, **fields) -> tuple[TurnTaking, SimpleNamespace]:
    endpointer = SimpleNamespace(in_utterance=True, config=EndpointConfig(endpoint_silence_ms=160))
    front_end = SimpleNamespace(resampler=SimpleNamespace(in_rate=RATE), endpointer=endpointer, silence_ms=0.0,
                                speech_start_sample=0, audio_since=lambda sample: heard[sample:])
    metrics = Metrics()

    async def queue_turn(turn):
        turns.append(turn)

    config = EndpointConfig(**{"smart_pause_ms": 160, "smart_early_ms": 32, "prepare_replies": False, **fields})
    return TurnTaking(config, model, front_end, Outbox(metrics), metrics, queue_turn, lambda turn: None), front_end


def utterance(text: str) -> Utterance:
    return Utterance("u1", Hypothesis(text, None, "test"), time.monotonic(), 1000.0, 0, 0.16, 0.01)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_early_answer_decides_the_pause_before_the_segment_has_ended():
    async def run():
        model, turns = HeldModel(), []
        room = np.full(RATE * 32 // 1000, 0.01, np.float32)
        heard = np.concatenate([np.ones(RATE, np.float32), room])  # 1 s of "speech", then 32 ms of the room
        taking, front_end = smart_turn_taking(model, heard, turns)
        front_end.silence_ms = 32.0
        await taking.after_chunk(32.0)  # the segment is still open: asked anyway, about the 160 ms pause
        await settle()
        (asked,) = model.asked
        assert len(asked) == RATE + RATE * 160 // 1000 and np.all(asked[RATE:] == np.float32(0.01))
        await model.answers.put(0.9)
        await settle()
        front_end.silence_ms = 96.0
        await taking.after_chunk(96.0)
        assert turns == []  # "complete" before the pause: held
        front_end.silence_ms, front_end.endpointer.in_utterance = 160.0, False
        taking.on_endpoint()  # the pause: the held answer stands, the turn ends with the transcript
        await taking.on_utterance(utterance("hello there"))
        assert [t.text for t in turns] == ["hello there"] and len(model.asked) == 1

    asyncio.run(run())


def test_speech_after_the_early_question_drops_it_and_asks_afresh():
    async def run():
        model, turns = HeldModel(), []
        taking, front_end = smart_turn_taking(model, np.ones(RATE, np.float32), turns)
        front_end.silence_ms = 32.0
        await taking.after_chunk(32.0)
        await settle()
        front_end.silence_ms = 0.0
        await taking.after_chunk(0.0)  # the user goes on: the question is cancelled
        assert model.cancelled == 1
        front_end.silence_ms = 64.0
        await taking.after_chunk(64.0)  # the next pause is asked about afresh, padded from its own silence
        await settle()
        assert len(model.asked) == 2 and len(model.asked[1]) == RATE + RATE * 96 // 1000

    asyncio.run(run())


def test_a_complete_said_before_the_transcript_is_withdrawn_when_it_stops_on_a_conjunction():
    async def run():
        model, turns = HeldModel(), []
        taking, front_end = smart_turn_taking(model, np.ones(RATE, np.float32), turns, smart_early_ms=0,
                                              smart_reask_ms=160, smart_words_hold=3.0)
        front_end.silence_ms, front_end.endpointer.in_utterance = 160.0, False
        taking.on_endpoint()  # the pause: asked, the transcript still to come
        await settle()
        await model.answers.put(0.9)  # "complete", before the recognizer is done
        await settle()
        await taking.on_utterance(utterance("we need eggs and"))
        assert turns == []  # the words withdrew it: the user has more to say
        front_end.silence_ms = 320.0
        await taking.after_chunk(320.0)  # the re-ask
        await settle()
        assert len(model.asked) == 2
        await model.answers.put(0.999)  # sure enough to outweigh the words: 0.999 -> 0.98
        await settle()
        assert [t.text for t in turns] == ["we need eggs and"]

    asyncio.run(run())


def test_a_question_particle_ends_a_turn_the_model_was_unsure_of_when_the_transcript_comes():
    async def run():
        model, turns = HeldModel(), []
        taking, front_end = smart_turn_taking(model, np.ones(RATE, np.float32), turns, smart_early_ms=0,
                                              smart_words_go=2.0)
        front_end.silence_ms, front_end.endpointer.in_utterance = 160.0, False
        taking.on_endpoint()
        await settle()
        await model.answers.put(0.5)  # below the 0.8 threshold alone
        await settle()
        assert turns == []
        await taking.on_utterance(utterance("你今年多大了吗"))
        assert [t.text for t in turns] == ["你今年多大了吗"]

    asyncio.run(run())
