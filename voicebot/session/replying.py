"""The replying stage: a Turn in, paced reply frames out, and what the listener heard remembered.

    Turn ─► responder (text deltas) ─► speech filter ─► TTS (SpeechChunk) ─► Framer ─► frames
         ─► prebuffer ─► Pacer ─► outbox (AudioFrame)

A `Reply` has an owner (the session) that decides its fate: `start()` runs the responder and TTS
into the reply's own frame queue (its holding buffer, FRAMES_MAX frames), `play()` sends those
frames paced and ends the reply, `cancel()` stops it and accounts for every frame not sent.
`run()` is start-then-play, what a reply to a confirmed turn does. A reply prepared during a pause
(voicebot/session/turn_taking.py) calls `prepare()` early, then `run()` or `discard()` once the
turn is decided: until `play()` nothing of it reaches the outbox (its events are held) and the
user's words are not in the conversation, so a discarded reply leaves no trace but its count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import numpy as np

from voicebot import protocol
from voicebot.audio.framing import Framer
from voicebot.audio.loudness import OutputLevel
from voicebot.audio.rates import SPEAK_RATE
from voicebot.audio.resample import float_to_pcm16
from voicebot.config.engines import ReplyConfig
from voicebot.config.stages import OutputConfig, PacingConfig
from voicebot.messages import Turn
from voicebot.metrics import Metrics
from voicebot.pacing import HeardText, Pacer
from voicebot.protocol import ErrorCode
from voicebot.reply.base import Responder, ResponderError
from voicebot.reply.deadline import within_deadline
from voicebot.reply.history import Conversation
from voicebot.reply.safety import SpeechFilter
from voicebot.reply.spoken import spoken
from voicebot.session import events
from voicebot.session.events import ServerEvent
from voicebot.session.outbox import Outbox
from voicebot.tts.base import SynthesisContext

log = logging.getLogger("voicebot.session")

# Frames a reply holds ahead of playback: 50 frames = 10 s of reply audio per session (480 KB).
FRAMES_MAX = 50


@dataclass(frozen=True)
class Replying:
    """What one session's replies use; `reply(turn, ...)` makes one."""

    tts: SynthesisContext
    conversation: Conversation
    outbox: Outbox
    metrics: Metrics
    speech_filter: SpeechFilter
    reply_config: ReplyConfig
    pacing: PacingConfig
    clock: Callable[[], float] = time.monotonic  # the pacer's; a test passes its event loop's
    # The session's output level (config output.*); by default as synthesized, under 0 dBFS true peak.
    level: OutputLevel = field(default_factory=lambda: OutputLevel(SPEAK_RATE, OutputConfig(loudness_lufs=None, true_peak_dbtp=0.0)))

    def reply(self, turn: Turn, responder_name: str, responder: Responder, on_speaking: Callable[[], None]) -> "Reply":
        return Reply(self, turn, responder_name, responder, on_speaking)


class Reply:
    """One reply: respond, synthesize, frame, pace, and account for what was heard."""

    def __init__(self, stage: Replying, turn: Turn, responder_name: str, responder: Responder,
                 on_speaking: Callable[[], None]) -> None:
        self.stage = stage
        self.turn = turn
        self.responder_name = responder_name
        self.responder = responder
        self._on_speaking = on_speaking  # called as the first frame goes out
        self.id = uuid.uuid4().hex[:12]
        self.frames: asyncio.Queue[bytes | None] = asyncio.Queue(FRAMES_MAX)  # None: the producer's end
        self.framer = Framer(SPEAK_RATE, protocol.FRAME_MS)
        self.level = stage.level.reply()  # loudness and true peak, before framing
        self.pacer = Pacer(protocol.FRAME_MS, stage.pacing.lead_ms, clock=stage.clock)
        self.heard = HeardText()
        self.text = ""
        self.started = time.monotonic()
        self.first_text_at: float | None = None
        self.first_audio_at: float | None = None
        self.first_frame_at: float | None = None
        self.failed = False  # the responder failed (the text may be the fallback line)
        self._remembered: str | None = None  # what the conversation holds of this reply, once it does
        self._produced_samples = 0
        self.frames_produced = 0  # framed for self.frames (queued or waiting for room); less pacer.frames_sent: never sent
        self._producer: asyncio.Task | None = None
        # A prepared reply's events (reply.delta, reply.done, a responder error) until play():
        # bounded by reply.max_reply_chars of text. None: emitted as they come.
        self._held: list[ServerEvent] | None = None
        self._history: list[dict] = []  # the conversation before this turn, as the responder gets it
        self._scrubber = stage.speech_filter.scrubber()  # its blocklist and length limit, and what the limit cut

    # ---- the owner's controls -------------------------------------------------------------------

    async def run(self) -> None:
        if self._producer is None:
            self.start()
        await self.play()

    def start(self) -> None:
        """Begin the responder and TTS into the frame queue; nothing is sent yet."""
        self._history = self.stage.conversation.messages()
        if not self.turn.say:
            self.stage.conversation.add_user(self.turn.text)
        self._producer = asyncio.create_task(self._produce())

    def prepare(self) -> None:
        """Begin like start(), for a turn not yet confirmed: events held, history untouched."""
        self._history = self.stage.conversation.messages()
        self._held = []
        self._producer = asyncio.create_task(self._produce())

    async def discard(self) -> None:
        """A prepared reply the turn did not confirm: stop it, count its frames; it never played."""
        if self._producer is not None and not self._producer.done():
            self._producer.cancel()  # closes the responder's stream and drops the synthesis steps
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._producer
        self.drop_pending("preemptive")

    async def play(self) -> None:
        """Send the frames paced, to the end of the reply (cancel the caller to stop it)."""
        if self._held is not None:  # a prepared reply, confirmed: now the client hears of it
            if not self.turn.say:
                self.stage.conversation.add_user(self.turn.text)
            while self._held:  # in order, with what the producer adds meanwhile
                await self._send_event(self._held.pop(0))
            self._held = None
        producer = self._producer
        try:
            await self._send_paced()
            await producer  # re-raises a synthesis failure
        except asyncio.CancelledError:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await producer
            raise
        except Exception as exc:
            # Everything synthesized before the failure was sent (the producer flushed it and put
            # its end marker): the reply ends there, and the conversation keeps what was heard.
            log.error("synthesis failed in reply %s", self.id, exc_info=exc)
            self.stage.metrics.engine_failures.labels("tts", "synthesis").inc()
            await self.stage.outbox.error(ErrorCode.ENGINE_ERROR, f"synthesis failed; the reply ends here: {exc}",
                                          reply_id=self.id, engine="tts", stage="synthesis")
            self._remember(self._heard_before_failure())
        await self._finished()

    async def cancel(self, reason: str, played_ms: float | None = None) -> None:
        """Stop the reply (its owner cancels a running play() first): stop the producer, drop and
        count what was not sent, keep what was heard (of `played_ms` if the client said how much it
        played), and tell the client."""
        if self._producer is not None and not self._producer.done():
            self._producer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._producer
        dropped = self.drop_pending("interrupted")
        self.stage.metrics.replies_interrupted.labels(reason).inc()
        played_ms = self.pacer.played_ms() if played_ms is None else played_ms
        heard = self.remember_heard(played_ms)
        self.stage.metrics.underruns.inc(self.pacer.underruns)
        await self.stage.outbox.emit(events.AudioInterrupted(self.id, reason, self.pacer.frames_sent, dropped, round(played_ms),
                                                             heard))

    def drop_pending(self, reason: str) -> int:
        """Count (and drop) every frame produced but not sent."""
        dropped = self.frames_produced - self.pacer.frames_sent
        if self.framer.clear():
            dropped += 1
        self.stage.metrics.frames_dropped.labels(reason).inc(dropped)
        return dropped

    def truncate(self, played_ms: float) -> str:
        """The client played only `played_ms` of this reply (it says so: /v1/realtime's
        conversation.item.truncate): the conversation keeps only what that much audio held."""
        heard = self.heard.heard(int(played_ms * SPEAK_RATE / 1000))
        if self._remembered is None:
            self._remember(heard)
        elif self._remembered != heard:
            if not self.turn.say:
                self.stage.conversation.revise_assistant(self._remembered, heard)
            self._remembered = heard
        return heard

    def remember_heard(self, played_ms: float | None = None) -> str:
        """Put what the listener heard of this reply so far into the conversation (once)."""
        played_ms = self.pacer.played_ms() if played_ms is None else played_ms
        heard = self.heard.heard(int(played_ms * SPEAK_RATE / 1000))
        self._remember(heard)
        return heard

    def _heard_before_failure(self) -> str:
        """What the listener hears of a reply whose synthesis failed: all that was sent, but
        nothing of the sentence being synthesized (its audio stops at a point no text marks)."""
        segments = self.heard.segments
        complete = segments[-1].start if segments else 0
        return self.heard.heard(min(self.pacer.samples_sent, complete))

    # ---- producing: responder ─► TTS ─► framer ─► frames ----------------------------------------

    def _texts(self) -> AsyncIterator[str]:
        stage = self.stage
        if self.turn.say:
            return stage.speech_filter.apply(_one(self.turn.text), self._scrubber)
        history = self._history
        if stage.conversation.instructions:  # the client's system prompt, in place of the persona
            history = [{"role": "system", "content": stage.conversation.instructions}, *history]
        limits = stage.reply_config.openai  # the reply timeouts, for every responder (voicebot/reply/deadline.py)
        deltas = within_deadline(self.responder.reply(history, self.turn.text, voice=stage.tts.voice),
                                 limits.idle_timeout_s, limits.total_timeout_s)
        return spoken(deltas, stage.speech_filter, stage.reply_config.fallback_line, self._responder_failed, self._scrubber)

    async def _responder_failed(self, exc: ResponderError) -> None:
        self.failed = True
        self.stage.metrics.reply_errors.labels(exc.kind).inc()
        self.stage.metrics.engine_failures.labels("responder", "stream").inc()
        log.warning("responder %s failed (%s): %s", self.responder_name, exc.kind, exc)
        await self._emit(events.Error(ErrorCode.REPLY_FAILED, f"the responder failed ({exc.kind}): {exc}",
                                      {"reply_id": self.id, "failure": exc.kind}))

    async def _text_deltas(self) -> AsyncIterator[str]:
        metrics = self.stage.metrics
        async with contextlib.aclosing(self._texts()) as texts:
            async for delta in texts:
                if self.first_text_at is None:
                    self.first_text_at = time.monotonic()
                    if not (self.turn.say or self.failed):  # responder latency only
                        metrics.reply_first_text.observe(self.first_text_at - self.started)
                self.text += delta
                await self._emit(events.ReplyDelta(self.id, delta))
                yield delta
        if not (self.turn.say or self.failed):
            metrics.reply_total.observe(time.monotonic() - self.started)
        if cut := self._scrubber.cut:  # reply.max_reply_chars reached: what was not spoken, said and counted
            await self._emit(events.Error(
                ErrorCode.REPLY_CUT, f"the reply reached reply.max_reply_chars ({self.stage.speech_filter.max_chars} "
                f"characters): {len(cut)} characters{' of the say' if self.turn.say else ''} were not spoken",
                {"reply_id": self.id, "cut_text": cut, "cut_chars": len(cut)}))
        await self._emit(events.ReplyDone(self.id, self.text))

    async def _emit(self, event: ServerEvent) -> None:
        if self._held is not None:
            self._held.append(event)
        else:
            await self._send_event(event)

    async def _send_event(self, event: ServerEvent) -> None:
        if isinstance(event, events.Error):
            self.stage.metrics.errors.labels(event.code).inc()
        await self.stage.outbox.emit(event)

    async def _produce(self) -> None:
        """Synthesize into frames, then put the end marker. The marker is awaited like every frame:
        with a full queue (synthesis ahead of playback) it waits for room instead of being lost.
        A synthesis failure ends the reply the same way, after what was synthesized before it,
        and is re-raised for play() to report. Cancelled (barge-in, close): no marker, the pacer
        is cancelled with us."""
        failure = None
        try:
            await self._synthesize()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failure = exc
        await self._put_frames(self.framer.push(self.level.flush()))
        last = self.framer.flush()
        if last is not None:
            await self._put_frames([last])
        await self.frames.put(None)
        if failure is not None:
            raise failure

    async def _synthesize(self) -> None:
        deltas = self._text_deltas()
        try:
            async with contextlib.aclosing(self.stage.tts.stream(deltas)) as chunks:
                async for chunk in chunks:
                    if self.first_audio_at is None and len(chunk.audio):
                        self.first_audio_at = time.monotonic()
                        self.stage.metrics.tts_first_audio.observe(self.first_audio_at - (self.first_text_at or self.started))
                    self.heard.add(chunk.text, chunk.segment, self._produced_samples, len(chunk.audio))
                    self._produced_samples += len(chunk.audio)
                    await self._put_frames(self.framer.push(self.level.process(chunk.audio)))
        finally:
            # Close the text source now, not when it is garbage collected: on barge-in the
            # responder's HTTP stream must close at once.
            await deltas.aclose()

    async def _put_frames(self, frames: list[np.ndarray]) -> None:
        # Counted before they wait for room: a reply cancelled meanwhile drops them, and says so.
        self.frames_produced += len(frames)
        for frame in frames:
            await self.frames.put(float_to_pcm16(frame))

    # ---- playing: prebuffer ─► pacer ─► outbox --------------------------------------------------

    async def _send_paced(self) -> None:
        stage = self.stage
        async for frame in self._frames_prebuffered():
            if self.pacer.frames_sent == 0:
                self._on_speaking()
                await stage.outbox.emit(events.AudioStart(self.id, SPEAK_RATE, protocol.FRAME_MS))
            await self.pacer.wait_turn()
            await stage.outbox.frame(frame)
            self.pacer.sent(len(frame) // 2, SPEAK_RATE)
            stage.metrics.frames_sent.inc()
            if self.first_frame_at is None:
                self.first_frame_at = time.monotonic()
                if self.turn.speech_end is not None:
                    stage.metrics.first_audio.observe(self.first_frame_at - self.turn.speech_end)

    async def _frames_prebuffered(self) -> AsyncIterator[bytes]:
        """The producer's frames in order, the first only once `pacing.prebuffer_ms` of audio (or
        the whole reply, if shorter) is ready; ends at the producer's end marker."""
        held: list[bytes] = []
        while len(held) < self.stage.pacing.prebuffer_ms // protocol.FRAME_MS:
            if (frame := await self.frames.get()) is None:
                for frame in held:
                    yield frame
                return
            held.append(frame)
        for frame in held:
            yield frame
        while (frame := await self.frames.get()) is not None:
            yield frame

    def timings(self) -> dict:
        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((a - b) * 1000, 1)

        return {
            "first_audio_ms": ms(self.first_frame_at, self.turn.speech_end),
            "reply_first_text_ms": ms(self.first_text_at, self.started),
            "tts_first_audio_ms": ms(self.first_audio_at, self.first_text_at),
            "underruns": self.pacer.underruns,
        }

    async def _finished(self) -> None:
        self.stage.metrics.underruns.inc(self.pacer.underruns)
        self._remember(self.text)
        if self.pacer.frames_sent:
            await self.stage.outbox.emit(events.AudioEnd(self.id, self.pacer.frames_sent, self.pacer.samples_sent, self.timings()))

    def _remember(self, text: str) -> None:
        if self._remembered is None:
            if not self.turn.say:
                self.stage.conversation.add_assistant(text)
            self._remembered = text


async def _one(text: str) -> AsyncIterator[str]:
    yield text
