"""Between the listening stage and the turn queue: has the user finished, or only paused?

    Listening ─► Utterance (a segment, ended by a short pause) ─► TurnTaking ─► Turn ─► turns
                                                                   │ at each pause: ask Smart Turn,
                                                                   │ and prepare the reply meanwhile

With `endpoint.turn: smart` the endpointer ends a segment after `smart_pause_ms` of silence, and
a turn is the segments the user says until the policy (voicebot/audio/turn.py) decides it is over:
Smart Turn says "complete", or the silence reaches `smart_limit_ms`. The recognizer finishes each
segment at its pause (the FunASR offline pass and dialect fallback included), so their cost
overlaps the wait. Its transcript is the policy's other evidence: each segment's, as it comes
(`on_utterance`), goes to `TurnPolicy.on_text`, and a "complete" the model said before it is
only acted on once it is in and the words still agree (a turn stopping on "and" waits). With
`turn: silence` every segment is a turn, as the silence rule always did.

A reply prepared at a pause (`prepare_replies`) runs the responder and synthesis into the reply's
own buffer, with its events held: if the turn ends on the same transcript it plays at once; if the
user goes on (or the transcript differs) it is discarded: its HTTP stream closed, its frames
dropped and counted, never heard, never in the history. Outcomes: voicebot_preemptive_total.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Awaitable, Callable

import numpy as np

from voicebot.audio.rates import LISTEN_RATE
from voicebot.audio.turn import Action, Answer, SmartTurn, TurnPolicy, with_silence
from voicebot.config.stages import EndpointConfig
from voicebot.messages import AudioIn, Inbound, InputEnd, Turn, Utterance
from voicebot.metrics import Metrics
from voicebot.session.events import TurnEnd
from voicebot.session.listening import FrontEnd
from voicebot.session.outbox import Outbox
from voicebot.session.replying import Reply
from voicebot.text import joined

log = logging.getLogger("voicebot.session")

# How much later than the silence limit (or than the next chunk was due) the wall clock takes
# over: a streaming client's chunks (20-100 ms each) arrive with jitter, and its own audio should
# end its turn, not the timer.
STALL_GRACE_S = 0.25


def normalised(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s']", " ", text.lower()).split())


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


class TurnTaking:
    """One session's turns (see the module doc). Runs on the event loop."""

    def __init__(self, config: EndpointConfig, smart: SmartTurn | None, front_end: FrontEnd, outbox: Outbox,
                 metrics: Metrics, queue_turn: Callable[[Turn], Awaitable[None]],
                 prepare: Callable[[Turn], Reply | None]) -> None:
        self.config = config
        self.smart = smart
        self.policy = TurnPolicy(config, smart=smart is not None)
        self._front_end = front_end
        self._outbox = outbox
        self._metrics = metrics
        self._queue_turn = queue_turn
        self._prepare = prepare  # None from it: the session is busy, nothing to prepare
        self._segments: list[Utterance] = []  # of the open turn: at most one per pause until it ends
        self._recognizing = False  # a segment has ended and its transcript is not in yet
        self._complete_early = False  # the model said "complete" before that transcript came
        self._turn_start = 0  # input sample where the open turn began
        self._ask: asyncio.Task | None = None
        # Audio time stands still when a client stops sending (push-to-talk, a stalled uplink,
        # a client that sent its tail and waits): then the silence limit runs on the wall clock
        # (next_input), from the last chunk: (when it arrived, how long it was).
        self._last_chunk: tuple[float, float] | None = None
        self._stalled = False  # the InputEnd being handled is next_input's, not the client's
        self._held: Inbound | None = None  # taken from the queue behind a run of chunks: the next input
        self._answered: tuple[float, float, Answer] | None = None  # this pause's last answer: (asked at, answered at, it)
        self._prepared: Reply | None = None
        self._prepared_text = ""
        self._kept: tuple[Turn, Reply] | None = None  # queued with its turn, until the session claims it

    def use(self, smart: SmartTurn | None) -> None:
        """Switch between the smart policy and the silence rule (session.update), between turns."""
        self.smart = smart
        self.policy.smart = smart is not None

    @property
    def open(self) -> bool:
        """A turn has begun and is not decided yet."""
        return bool(self._segments)

    def on_endpoint(self) -> None:
        """A segment ended at a pause, its transcript still to come: ask the model now, so its
        answer and the recognizer's finish (offline pass, dialect fallback) overlap."""
        self._recognizing = True
        if not self._segments:
            self._turn_start = self._front_end.speech_start_sample
        if self._consider(self._front_end.silence_ms) is Action.COMPLETE:  # the early answer stands
            self._decided_complete()

    async def on_utterance(self, utterance: Utterance, input_end: bool = False) -> None:
        """A segment ended at a pause, at the utterance length limit, or at the client's input.end."""
        self._recognizing = False
        if utterance.text.strip():
            self._segments.append(utterance)
        elif not self._segments:  # noise, not a turn: forget the question about it
            await self._drop_question()
            self.policy.reset()
            self._complete_early = False
            return
        # The words weigh in on the model's last answer: a "complete" said before the transcript
        # came may be withdrawn ("... and"), an "incomplete" may become one ("...吗").
        complete = self.smart is not None and self.open and self.policy.on_text(
            joined([s.text for s in self._segments]), self._front_end.silence_ms)
        if self._complete_early and self.open:
            self._complete_early = False
            if complete:
                await self._end("smart")
            elif self.config.prepare_replies:
                await self._prepare_reply()
        elif input_end:
            await self.end_now()
        elif self.smart is None and self.open:
            await self._end("silence")
        elif complete:
            await self._end("smart")
        elif self.config.prepare_replies and utterance.text.strip():
            await self._prepare_reply()

    async def after_chunk(self, silence_ms: float) -> None:
        """After every chunk of input: how long the user has been silent (in an utterance too:
        the pause's question is asked before the endpointer ends it)."""
        if not (self.open or self._front_end.endpointer.in_utterance):
            return
        if silence_ms == 0:  # the user goes on: the question and the prepared reply are moot
            await self._drop_question()
            self._answered = None
            await self._discard("user_went_on")
            self._complete_early = False
        action = self._consider(silence_ms)
        if action is Action.END and self.open:
            await self._end("silence")
        elif action is Action.COMPLETE and not self._decided_complete() and self.open:
            await self._end("smart")

    async def next_input(self, queue: asyncio.Queue[Inbound]) -> Inbound:
        """The session's next input. While the user is in an utterance or a turn is open, a
        client that stops sending gets an InputEnd of ours once the silence it sent, and the wall
        clock since, reach the silence limit: the turn ends by silence as if the audio had come.
        A client that streams never reaches it (its next chunk is due before; STALL_GRACE_S)."""
        while True:
            self._stalled = False
            deadline = self._stall_deadline()
            if deadline is None:
                item = await queue.get()
            else:
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        item = await queue.get()  # on a timeout the item stays queued: nothing is lost
                except TimeoutError:
                    if self._stall_deadline() is None:
                        continue  # the model's answer ended the turn meanwhile
                    self._stalled = True
                    return InputEnd(time.monotonic())
            if isinstance(item, AudioIn):
                self._last_chunk = (item.arrived, len(item.pcm) / 2 / self._front_end.resampler.in_rate)
            return item

    async def next_batch(self, queue: asyncio.Queue[Inbound]) -> Inbound | list[AudioIn]:
        """The session's next input, as next_input gives it; a chunk with every chunk already
        waiting behind it, for one trip through the front end, the VAD and the recognizer: a session
        that fell behind catches up at once, where one trip per chunk would keep it behind
        (docs/serving.md, capacity and admission). The first other input behind them is held for
        the next call. next_input notes each chunk's arrival, and never waits on a queue that holds
        something."""
        if self._held is not None:
            item, self._held = self._held, None
        else:
            item = await self.next_input(queue)
        if not isinstance(item, AudioIn):
            return item
        chunks: list[AudioIn] = [item]
        while not queue.empty():
            item = await self.next_input(queue)
            if not isinstance(item, AudioIn):
                self._held = item
                break
            chunks.append(item)
        return chunks

    def _stall_deadline(self) -> float | None:
        """When no input means the client has stopped and the silence limit is reached (monotonic)."""
        if self._last_chunk is None or not (self.open or self._front_end.endpointer.in_utterance):
            return None
        arrived, chunk_s = self._last_chunk
        # The silence rule's wait is the endpointer's: the session may have set its own (session.update;
        # /v1/realtime's manual commits wait 5 s), which the policy's server-wide limit does not know.
        limit_ms = self.policy.limit_ms if self.smart is not None else self._front_end.endpointer.config.endpoint_silence_ms
        remaining_s = max(0.0, limit_ms - self._front_end.silence_ms) / 1000
        # Not before the next chunk is late: a client sending 1 s chunks is not stalled after 0.5 s.
        return arrived + max(remaining_s, chunk_s) + STALL_GRACE_S

    def _consider(self, silence_ms: float) -> Action:
        action = self.policy.on_silence(silence_ms)
        if action is Action.ASK:
            if not self._segments:  # the turn's first segment, still open
                self._turn_start = self._front_end.speech_start_sample
            heard = self._front_end.audio_since(self._turn_start)
            audio = with_silence(heard, min(len(heard), round(silence_ms * LISTEN_RATE / 1000)),
                                 round(self.policy.asked_for_ms * LISTEN_RATE / 1000))
            self._ask = asyncio.create_task(self._asking(self.policy.question, audio, time.monotonic()))
        return action

    async def end_now(self) -> None:
        """input.end: the client says the turn is over (or next_input found the client stopped)."""
        if self.open:
            await self._end("silence" if self._stalled else "input.end")

    async def close(self) -> None:
        await self._drop_question()
        await self._discard("session_closed")
        if self._kept is not None:
            await self._kept[1].discard()
            self._kept = None
        self._segments = []

    # ---- the model's question -------------------------------------------------------------------

    async def _asking(self, question: int, audio: np.ndarray, asked_at: float) -> None:
        try:
            answer = await self.smart.ask(audio)
        except Exception:  # no answer: no more questions this turn, the silence limit ends it
            log.exception("the end-of-turn model failed; this turn ends at the silence limit")
            return
        answered_at = time.monotonic()
        self._answered = (asked_at, answered_at, answer)
        self._metrics.smart_turn.observe(answered_at - asked_at)
        if self.policy.on_answer(question, answer.probability, self._front_end.silence_ms):
            self._ask = None  # this task is ending the turn: _end must not cancel it
            if not self._decided_complete() and self.open:
                await self._end("smart")

    def _decided_complete(self) -> bool:
        """The model said "complete" at the pause: True if the turn ends once the transcript is in
        (on_utterance), False if the caller is to end it now."""
        if self._recognizing:
            self._complete_early = True
        return self._recognizing

    async def _drop_question(self) -> None:
        task, self._ask = self._ask, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- prepared replies -----------------------------------------------------------------------

    async def _prepare_reply(self) -> None:
        await self._discard("changed")  # an earlier pause's, on less of the transcript
        text = joined([s.text for s in self._segments])
        reply = self._prepare(self._turn(text))
        if reply is not None:
            self._prepared, self._prepared_text = reply, normalised(text)

    async def _discard(self, outcome: str) -> None:
        reply, self._prepared = self._prepared, None
        if reply is not None:
            self._metrics.preemptive.labels(outcome).inc()
            await reply.discard()

    def claim(self, turn: Turn) -> Reply | None:
        """The prepared reply of this turn, for the session to play instead of starting one."""
        if self._kept is not None and self._kept[0] is turn:
            reply, self._kept = self._kept[1], None
            return reply
        return None

    # ---- the end of a turn ----------------------------------------------------------------------

    def _turn(self, text: str) -> Turn:
        last = self._segments[-1]
        return Turn(text, say=False, speech_end=last.speech_end, utterance_id=last.id)

    def _model_timings(self, by: str, speech_end: float) -> dict:
        """Where the decision's time went: end of speech to the last question, its wait behind
        another session's call, the call itself; decision_ms (asked to answered) when it decided."""
        if self._answered is None:
            return {"asked_ms": None, "queued_ms": None, "model_ms": None, "decision_ms": None}
        asked_at, answered_at, answer = self._answered
        return {
            "asked_ms": _ms(asked_at - speech_end),
            "queued_ms": _ms(answer.queued_s),
            "model_ms": _ms(answer.model_s),
            "decision_ms": _ms(answered_at - asked_at) if by == "smart" else None,
        }

    async def _end(self, by: str) -> None:
        await self._drop_question()
        text = joined([s.text for s in self._segments])
        turn = self._turn(text)
        pause_ms = self._front_end.silence_ms
        decided = self.policy.end(by, pause_ms)
        self._metrics.turn_ends.labels(by).inc()
        last = self._segments[-1]
        await self._outbox.emit(TurnEnd(
            utterance_id=last.id,
            by=by,
            probability=None if decided.probability is None else round(decided.probability, 3),
            text=text,
            timings={
                "pause_ms": round(pause_ms),
                **self._model_timings(by, last.speech_end),
                "end_of_speech_ms": _ms(time.monotonic() - last.speech_end),
            },
        ))
        self._segments = []
        self._answered = None
        prepared = self._prepared
        if prepared is not None and self._prepared_text == normalised(text):
            self._prepared = None
            self._metrics.preemptive.labels("kept").inc()
            self._kept = (turn, prepared)
        else:
            await self._discard("changed")
        await self._queue_turn(turn)
