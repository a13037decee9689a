"""One /v1/voice connection: receive, listen, think, speak and send, as asyncio tasks.

    socket ─► receive ─► audio_in ─► listen (resample ─► gate ─► endpoint ─► recognize) ─► turns
                                                                                              │
    socket ◄── send ◄── outbox ◄── pace ◄── frames ◄── speak (respond ─► synthesize ─► frame) ◄┘

Queues between the tasks are bounded (sizes below), so a slow stage pushes back instead of
buffering without limit. Model work runs on engine workers, never on the event loop. The state
enum says what the bot is doing; barge-in (user speech while SPEAKING) cancels the reply at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable


from voicebot import protocol
from voicebot.audio.endpoint import Endpointer, EventKind
from voicebot.audio.framing import Framer
from voicebot.audio.gate import NoiseGate
from voicebot.audio.resample import StreamResampler, float_to_pcm16, pcm16_to_float
from voicebot.pacing import HeardText, Pacer
from voicebot.protocol import CloseCode, ErrorCode, ProtocolError
from voicebot.reply.base import ResponderError
from voicebot.reply.history import Conversation
from voicebot.reply.spoken import spoken
from voicebot.tts.base import SAMPLE_RATE as OUTPUT_RATE

if TYPE_CHECKING:
    from voicebot.app import Runtime

log = logging.getLogger("voicebot.session")

ASR_RATE = 16000
# Queue bounds. audio_in: 64 chunks of at most 1 s each (the client's chunk size, typically
# 20-100 ms, so about 6 s of audio in practice). outbox: 64 messages, at most 64 frames of
# 9600 bytes. frames: 50 frames = 10 s of reply audio per session (480 KB).
AUDIO_IN_MAX = 64
OUTBOX_MAX = 64
FRAMES_MAX = 50
TURNS_MAX = 8


class State(Enum):
    STARTING = "starting"  # connected, waiting for session.start
    LISTENING = "listening"
    THINKING = "thinking"  # a reply is being prepared, no audio sent yet
    SPEAKING = "speaking"
    CLOSING = "closing"


@dataclass
class Turn:
    """A reply to make: to what the user said (via the responder), or a `say` text spoken as is."""

    text: str
    say: bool
    speech_end: float | None = None  # monotonic time the user stopped talking
    utterance_id: str | None = None


class FloodGuard:
    """Counts messages and audio bytes per window; past the limits the session is closed."""

    def __init__(self, max_messages_per_s: float, max_audio_factor: float, window_s: float) -> None:
        self.max_messages = max_messages_per_s * window_s
        self.max_audio_factor = max_audio_factor
        self.window_s = window_s
        self._start = time.monotonic()
        self._messages = 0
        self._audio_bytes = 0

    def check(self, audio_bytes: int, sample_rate: int) -> str | None:
        """Count one message; return why the session floods, or None."""
        now = time.monotonic()
        if now - self._start >= self.window_s:
            self._start, self._messages, self._audio_bytes = now, 0, 0
        self._messages += 1
        self._audio_bytes += audio_bytes
        if self._messages > self.max_messages:
            return f"more than {self.max_messages / self.window_s:.0f} messages per second"
        allowed = self.max_audio_factor * sample_rate * 2 * self.window_s
        if self._audio_bytes > allowed:
            return f"audio faster than {self.max_audio_factor:g}x real time"
        return None


class Session:
    def __init__(self, runtime: "Runtime", send_text: Callable[[str], Awaitable], send_bytes: Callable[[bytes], Awaitable]) -> None:
        self.rt = runtime
        self.settings = runtime.settings
        self._send_text = send_text
        self._send_bytes = send_bytes
        self.id = uuid.uuid4().hex
        self.state = State.STARTING
        self.sample_rate = 16000
        self.responder_name = runtime.default_responder
        self.language: str | None = None
        self.barge_in_min_ms = self.settings.pacing.barge_in_min_ms
        self.conversation = Conversation(self.settings.reply.max_history_turns, self.settings.reply.max_history_tokens)
        self.flood = FloodGuard(
            self.settings.limits.max_messages_per_s, self.settings.limits.max_audio_realtime_factor, self.settings.limits.window_s
        )
        self.close_request: tuple[int, str] | None = None

        self.outbox: asyncio.Queue[str | bytes | None] = asyncio.Queue(OUTBOX_MAX)
        # (PCM, when it came off the socket); b"" marks input.end.
        self.audio_in: asyncio.Queue[tuple[bytes, float]] = asyncio.Queue(AUDIO_IN_MAX)
        self.turns: asyncio.Queue[Turn] = asyncio.Queue(TURNS_MAX)
        self._tasks: list[asyncio.Task] = []
        self._reply_task: asyncio.Task | None = None
        self._reply: "Reply | None" = None
        self._engine_lock = asyncio.Lock()  # held per audio chunk, to start a reply and by a reset
        self._last_reset = time.monotonic()
        self.reset_count = 0
        self._utterance_count = 0
        # (end of a chunk in 16 kHz samples, when it arrived): when the user stopped talking, even
        # if the chunk waited in audio_in before it was processed.
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=256)
        self._samples_in = 0
        self.asr = None
        self.tts = None

    # ---- lifecycle ------------------------------------------------------------------------

    @property
    def replying(self) -> bool:
        """A reply is being made or played, or one is queued."""
        return self._reply is not None or not self.turns.empty()

    async def run_sender(self) -> None:
        """Drain the outbox to the socket; a None entry ends it."""
        while (item := await self.outbox.get()) is not None:
            self.rt.channels.mirror(self.id, item)  # never waits: listeners can't slow the session
            if isinstance(item, bytes):
                await self._send_bytes(item)
            else:
                await self._send_text(item)

    async def close(self) -> None:
        """Release every task, queue and engine state of this session (idempotent)."""
        if self.state is State.CLOSING:
            return
        self.state = State.CLOSING
        self.rt.channels.leave(self.id)
        reply = self._reply  # cancelling the speak task clears self._reply
        if self._reply_task:
            self._reply_task.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for t in [self._reply_task] if t), return_exceptions=True)
        if reply is not None:
            reply.drop_pending("client_gone")
            reply.remember_heard()  # a client that resumes finds what it heard of this reply
        self.rt.conversations.release(self.id)
        for engine_state in (self.asr, self.tts):
            if engine_state is not None:
                with contextlib.suppress(Exception):
                    await engine_state.close()
        self.asr = self.tts = None
        while not self.audio_in.empty():
            self.audio_in.get_nowait()

    # ---- input ----------------------------------------------------------------------------

    async def on_text(self, raw: str) -> None:
        if self._flooding(0):
            return
        try:
            message = protocol.parse_text(raw)
        except ProtocolError as exc:
            await self.error(exc.code, exc.message)
            return
        await self._dispatch(message)

    async def on_bytes(self, data: bytes) -> None:
        if self._flooding(len(data)):
            return
        if self.state is State.STARTING:
            await self.error(ErrorCode.NOT_STARTED, "audio before session.start: send session.start first")
            return
        if not data:
            return  # an empty frame carries nothing (and b"" in audio_in means input.end)
        try:
            protocol.check_audio(len(data), self.sample_rate)
        except ProtocolError as exc:
            await self.error(exc.code, exc.message)
            return
        self.rt.input_recorder.record(self.id, self.sample_rate, data)
        await self.audio_in.put((data, time.monotonic()))

    def _flooding(self, audio_bytes: int) -> bool:
        if self.close_request:
            return True
        reason = self.flood.check(audio_bytes, self.sample_rate)
        if reason:
            self.close_request = (CloseCode.FLOODING, f"flooding: {reason}")
            self.rt.metrics.errors.labels(ErrorCode.FLOODING).inc()
        return reason is not None

    async def _dispatch(self, message) -> None:
        if isinstance(message, protocol.SessionStart):
            if self.state is not State.STARTING:
                await self.error(ErrorCode.ALREADY_STARTED, "session.start was already received")
                return
            await self._start(message)
        elif self.state is State.STARTING and not isinstance(message, protocol.Ping):
            await self.error(ErrorCode.NOT_STARTED, f"{message.type} before session.start: send session.start first")
        elif isinstance(message, protocol.SessionUpdate):
            await self._update(message)
        elif isinstance(message, protocol.InputEnd):
            await self.audio_in.put((b"", time.monotonic()))  # in order with the audio before it
        elif isinstance(message, protocol.Say):
            if message.interrupt:
                await self.interrupt("say")
            await self._queue_turn(Turn(message.text, say=True))
        elif isinstance(message, protocol.Interrupt):
            await self.interrupt("client")
        elif isinstance(message, protocol.Ping):
            await self.emit(protocol.event("pong", id=message.id))

    async def _start(self, message: protocol.SessionStart) -> None:
        try:
            self._apply_choices(message.voice, message.responder, message.language, message.endpointing)
            self.tts = self.rt.synthesizer.open(message.voice)
        except ProtocolError as exc:
            await self.error(exc.code, exc.message)
            return
        self.sample_rate = message.sample_rate
        self.asr = self.rt.recognizer.open(self.language)
        self.resampler = StreamResampler(self.sample_rate, ASR_RATE)
        self.gate = NoiseGate(self.settings.gate, ASR_RATE)
        self.endpointer = Endpointer(self.settings.endpoint)
        if message.endpointing and message.endpointing.endpoint_silence_ms:
            self.endpointer.set_silence_ms(message.endpointing.endpoint_silence_ms)
        self.state = State.LISTENING
        if message.channel:
            self.rt.channels.speak(message.channel, self.id)
        resumed = self._resume(message.resume)
        await self.emit(protocol.session_ready(self.id, self.sample_rate, self.tts.voice, self.responder_name, resumed=resumed))
        self._tasks = [
            asyncio.create_task(self._listen(), name=f"listen-{self.id[:8]}"),
            asyncio.create_task(self._speak(), name=f"speak-{self.id[:8]}"),
            asyncio.create_task(self._reset_timer(), name=f"reset-{self.id[:8]}"),
        ]

    def _resume(self, previous_id: str | None) -> bool:
        """Take over a previous session's conversation if the store still has it; register ours."""
        conversation = self.rt.conversations.take(previous_id) if previous_id else None
        if conversation is not None:
            self.conversation = conversation
        self.rt.conversations.register(self.id, self.conversation)
        return conversation is not None

    def _apply_choices(self, voice, responder, language, endpointing) -> None:
        if voice is not None and voice not in {v.name for v in self.rt.synthesizer.voices()}:
            names = ", ".join(v.name for v in self.rt.synthesizer.voices())
            raise ProtocolError(ErrorCode.UNKNOWN_VOICE, f"unknown voice {voice!r}; available: {names}")
        if responder is not None:
            if responder not in self.rt.responders:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_RESPONDER, f"unknown responder {responder!r}; available: {', '.join(self.rt.responders)}"
                )
            self.responder_name = responder
        if language is not None:
            self.language = language
        if endpointing is not None and endpointing.barge_in_min_ms is not None:
            self.barge_in_min_ms = endpointing.barge_in_min_ms

    async def _update(self, message: protocol.SessionUpdate) -> None:
        try:
            self._apply_choices(message.voice, message.responder, message.language, message.endpointing)
        except ProtocolError as exc:
            await self.error(exc.code, exc.message)
            return
        if message.voice is not None:
            self.tts.set_voice(message.voice)
        if message.endpointing and message.endpointing.endpoint_silence_ms:
            self.endpointer.set_silence_ms(message.endpointing.endpoint_silence_ms)
        await self.emit(
            protocol.event(
                "session.updated",
                voice=self.tts.voice,
                responder=self.responder_name,
                language=self.language,
                endpoint_silence_ms=self.endpointer.config.endpoint_silence_ms,
                barge_in_min_ms=self.barge_in_min_ms,
            )
        )

    # ---- output ---------------------------------------------------------------------------

    async def emit(self, event: dict) -> None:
        await self.outbox.put(json.dumps(event, ensure_ascii=False))

    async def error(self, code: str, message: str, **extra) -> None:
        self.rt.metrics.errors.labels(code).inc()
        await self.emit(protocol.error(code, message, **extra))

    # ---- listen: audio in, transcripts out ---------------------------------------------------

    async def _listen(self) -> None:
        utterance: dict | None = None
        while True:
            data, arrived = await self.audio_in.get()
            async with self._engine_lock:
                if data == b"":
                    events = self.endpointer.force_end()
                else:
                    events = await self.rt.audio_worker.run(self._front_end, data, arrived)
                for ev in events:
                    utterance = await self._on_vad_event(ev, utterance)
            # While the reply is still being prepared too: the user has more to say.
            if self.state in (State.THINKING, State.SPEAKING) and self.endpointer.speech_run_ms >= self.barge_in_min_ms:
                await self.interrupt("barge_in")

    def _front_end(self, data: bytes, arrived: float) -> list:
        """Resample, gate and endpoint one chunk (blocking: runs on the audio worker)."""
        audio = self.resampler.process(pcm16_to_float(data))
        self._samples_in += len(audio)
        self._arrivals.append((self._samples_in, arrived))
        muted_before = self.gate.muted_samples
        gated = self.gate.process(audio) if self.settings.gate.enabled else audio
        muted = self.gate.muted_samples - muted_before
        if muted:
            self.rt.metrics.gate_muted.inc(muted / ASR_RATE)
            self._muted_in_utterance = getattr(self, "_muted_in_utterance", 0) + muted
        return self.endpointer.process(gated)

    async def _on_vad_event(self, ev, utterance: dict | None) -> dict | None:
        if ev.kind is EventKind.START:
            self._utterance_count += 1
            self._muted_in_utterance = 0
            utterance = {"id": f"u{self._utterance_count}", "partial": ""}
            await self.emit(protocol.event("speech.started", utterance_id=utterance["id"]))
        if ev.kind in (EventKind.START, EventKind.AUDIO) and utterance is not None:
            try:
                partial = await self.asr.accept(ev.audio)
            except Exception as exc:  # a model failing on this input must not end the session
                log.exception("recognizer failed")
                await self.error(ErrorCode.ENGINE_ERROR, f"recognizer failed: {exc}")
                return utterance
            if partial is not None:
                await self.emit(protocol.event("asr.partial", utterance_id=utterance["id"], text=partial))
        elif ev.kind is EventKind.END and utterance is not None:
            await self._finish_utterance(ev, utterance)
            return None
        return utterance

    async def _finish_utterance(self, ev, utterance: dict) -> None:
        endpoint_at = time.monotonic()
        speech_end = self._time_of_sample(ev.speech_end_sample) if ev.speech_end_sample else endpoint_at
        try:
            hyp = await self.asr.finish()
        except Exception as exc:
            log.exception("recognizer failed")
            await self.error(ErrorCode.ENGINE_ERROR, f"recognizer failed: {exc}")
            return
        final_at = time.monotonic()
        m = self.rt.metrics
        m.endpoint_delay.observe(endpoint_at - speech_end)
        m.asr_final.observe(final_at - endpoint_at)
        used_model = hyp.model
        m.utterances.labels(used_model).inc()
        if hyp.fallback is not None:
            m.dialect_fallbacks.labels("dialect" if hyp.model == hyp.fallback.model else "primary").inc()
        if hyp.confidence is not None:
            m.asr_confidence.labels(used_model).observe(hyp.confidence)
        muted_ms = round(getattr(self, "_muted_in_utterance", 0) * 1000 / ASR_RATE)
        await self.emit(
            protocol.event(
                "asr.final",
                utterance_id=utterance["id"],
                **hyp.to_event(),
                gate_muted_ms=muted_ms,
                timings={
                    "endpoint_delay_ms": round((endpoint_at - speech_end) * 1000, 1),
                    "asr_final_ms": round((final_at - endpoint_at) * 1000, 1),
                },
            )
        )
        log.info(
            json.dumps(
                {
                    "event": "utterance",
                    "session": self.id,
                    "utterance": utterance["id"],
                    "text": hyp.text,
                    "model": hyp.model,
                    "confidence": hyp.confidence,
                    "fallback": hyp.to_event()["fallback"],
                    "speech_ms": ev.speech_ms,
                    "gate_muted_ms": muted_ms,
                    "endpoint_delay_ms": round((endpoint_at - speech_end) * 1000, 1),
                    "asr_final_ms": round((final_at - endpoint_at) * 1000, 1),
                },
                ensure_ascii=False,
            )
        )
        if hyp.text.strip():
            await self._queue_turn(Turn(hyp.text, say=False, speech_end=speech_end, utterance_id=utterance["id"]))

    def _time_of_sample(self, sample: int) -> float:
        """When the chunk holding this 16 kHz input sample arrived."""
        for end, arrived in self._arrivals:
            if end >= sample:
                return arrived
        return time.monotonic()

    async def _queue_turn(self, turn: Turn) -> None:
        if self.turns.full():
            await self.error(ErrorCode.ENGINE_ERROR, "too many replies queued; this one is dropped", dropped_text=turn.text)
            return
        await self.turns.put(turn)

    # ---- speak: turns in, paced frames out ----------------------------------------------------

    async def _speak(self) -> None:
        while True:
            turn = await self.turns.get()
            # The lock only makes a reply wait for a reset in progress. Held for the whole reply,
            # it stopped _listen for that long, so barge-in could never happen; the reset timer
            # checks self._reply under the lock instead.
            async with self._engine_lock:
                reply = Reply(self, turn)
                self._reply = reply
                self._reply_task = asyncio.create_task(reply.run(), name=f"reply-{self.id[:8]}")
            try:
                await self._reply_task
            except asyncio.CancelledError:
                if self.state is State.CLOSING:
                    raise
            finally:
                self._reply = self._reply_task = None
                if self.state is not State.CLOSING:
                    self.state = State.LISTENING

    async def interrupt(self, reason: str) -> None:
        """Stop the reply in progress at once and drop everything queued for it."""
        reply, task = self._reply, self._reply_task
        if reply is None or task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await reply.interrupted(reason)

    # ---- periodic reset ---------------------------------------------------------------------

    async def _reset_timer(self) -> None:
        interval = self.settings.reset.interval_s
        while True:
            await asyncio.sleep(max(0.05, min(1.0, interval / 4)))
            if time.monotonic() - self._last_reset < interval:
                continue
            # Only at a turn boundary: nothing being said by either side.
            if self._reply is not None or self.endpointer.in_utterance or not self.turns.empty():
                continue
            async with self._engine_lock:
                if self._reply is not None or self.endpointer.in_utterance:
                    continue
                await self.reset("periodic")

    async def reset(self, reason: str) -> None:
        start = time.perf_counter()
        reports = [await self.asr.reset(), await self.tts.reset()]
        duration = time.perf_counter() - start
        self._last_reset = time.monotonic()
        self.reset_count += 1
        self.rt.metrics.resets.inc()
        self.rt.metrics.reset_duration.observe(duration)
        await self.emit(
            protocol.event(
                "state.reset",
                reason=reason,
                duration_ms=round(duration * 1000, 2),
                engines=[{"engine": r.engine, "generation": r.generation, "bytes_freed": r.bytes_freed} for r in reports],
            )
        )


class Reply:
    """One reply: respond, synthesize, frame, pace, and account for what was heard."""

    def __init__(self, session: Session, turn: Turn) -> None:
        self.s = session
        self.turn = turn
        self.id = uuid.uuid4().hex[:12]
        self.frames: asyncio.Queue[bytes | None] = asyncio.Queue(FRAMES_MAX)
        self.framer = Framer(OUTPUT_RATE, protocol.FRAME_MS)
        self.pacer = Pacer(protocol.FRAME_MS, session.settings.pacing.lead_ms)
        self.heard = HeardText()
        self.text = ""
        self.started = time.monotonic()
        self.first_text_at: float | None = None
        self.first_audio_at: float | None = None
        self.first_frame_at: float | None = None
        self.failed = False  # the responder failed (the text may be the fallback line)
        self._remembered = False
        self._produced_samples = 0
        self.frames_produced = 0  # put on self.frames; less pacer.frames_sent = produced, never sent

    async def run(self) -> None:
        s = self.s
        s.state = State.THINKING
        if not self.turn.say:
            s.conversation.add_user(self.turn.text)
        producer = asyncio.create_task(self._produce())
        try:
            await self._send_paced()
            await producer  # re-raises a synthesis failure
        except asyncio.CancelledError:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await producer
            raise
        except Exception as exc:
            log.exception("reply failed")
            producer.cancel()
            await s.error(ErrorCode.ENGINE_ERROR, f"reply failed: {exc}", reply_id=self.id)
        await self._finished()

    def _texts(self) -> AsyncIterator[str]:
        s = self.s
        if self.turn.say:
            return s.rt.speech_filter.apply(_one(self.turn.text))
        deltas = s.rt.responders[s.responder_name].reply(s.conversation.messages()[:-1], self.turn.text, voice=s.tts.voice)
        return spoken(deltas, s.rt.speech_filter, s.settings.reply.fallback_line, self._responder_failed)

    async def _responder_failed(self, exc: ResponderError) -> None:
        self.failed = True
        self.s.rt.metrics.reply_errors.labels(exc.kind).inc()
        log.warning("responder %s failed (%s): %s", self.s.responder_name, exc.kind, exc)
        await self.s.error(ErrorCode.REPLY_FAILED, f"the responder failed ({exc.kind}): {exc}", reply_id=self.id, failure=exc.kind)

    async def _text_deltas(self) -> AsyncIterator[str]:
        metrics = self.s.rt.metrics
        async with contextlib.aclosing(self._texts()) as texts:
            async for delta in texts:
                if self.first_text_at is None:
                    self.first_text_at = time.monotonic()
                    if not (self.turn.say or self.failed):  # responder latency only
                        metrics.reply_first_text.observe(self.first_text_at - self.started)
                self.text += delta
                await self.s.emit(protocol.event("reply.delta", reply_id=self.id, text=delta))
                yield delta
        if not (self.turn.say or self.failed):
            metrics.reply_total.observe(time.monotonic() - self.started)
        await self.s.emit(protocol.event("reply.done", reply_id=self.id, text=self.text))

    async def _produce(self) -> None:
        """Synthesize into frames, then put the end marker. The marker is awaited like every frame:
        with a full queue (synthesis ahead of playback) it waits for room instead of being lost."""
        try:
            await self._synthesize()
        except asyncio.CancelledError:
            raise  # barge-in or close: the pacer is cancelled with us and reads no marker
        except Exception:
            await self.frames.put(None)  # the pacer sends what came before; run() reports the failure
            raise
        await self.frames.put(None)

    async def _synthesize(self) -> None:
        deltas = self._text_deltas()
        try:
            async with contextlib.aclosing(self.s.tts.stream(deltas)) as chunks:
                async for chunk in chunks:
                    if self.first_audio_at is None and len(chunk.audio):
                        self.first_audio_at = time.monotonic()
                        self.s.rt.metrics.tts_first_audio.observe(self.first_audio_at - (self.first_text_at or self.started))
                    self.heard.add(chunk.text, chunk.segment, self._produced_samples, len(chunk.audio))
                    self._produced_samples += len(chunk.audio)
                    for frame in self.framer.push(chunk.audio):
                        await self._put_frame(frame)
            last = self.framer.flush()
            if last is not None:
                await self._put_frame(last)
        finally:
            # Close the text source now, not when it is garbage collected: on barge-in the
            # responder's HTTP stream must close at once.
            await deltas.aclose()

    async def _put_frame(self, frame) -> None:
        await self.frames.put(float_to_pcm16(frame))
        self.frames_produced += 1

    async def _send_paced(self) -> None:
        s = self.s
        async for frame in self._frames_prebuffered():
            if self.pacer.frames_sent == 0:
                s.state = State.SPEAKING
                await s.emit(protocol.event("audio.start", reply_id=self.id, sample_rate=OUTPUT_RATE, frame_ms=protocol.FRAME_MS))
            await self.pacer.wait_turn()
            await s.outbox.put(frame)
            self.pacer.sent(len(frame) // 2, OUTPUT_RATE)
            s.rt.metrics.frames_sent.inc()
            if self.first_frame_at is None:
                self.first_frame_at = time.monotonic()
                if self.turn.speech_end is not None:
                    s.rt.metrics.first_audio.observe(self.first_frame_at - self.turn.speech_end)

    async def _frames_prebuffered(self) -> AsyncIterator[bytes]:
        """The producer's frames in order, the first only once `pacing.prebuffer_ms` of audio (or
        the whole reply, if shorter) is ready; ends at the producer's end marker."""
        held: list[bytes] = []
        while len(held) < self.s.settings.pacing.prebuffer_ms // protocol.FRAME_MS:
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
        s = self.s
        s.rt.metrics.underruns.inc(self.pacer.underruns)
        self._remember(self.text)
        if self.pacer.frames_sent:
            await s.emit(
                protocol.event(
                    "audio.end",
                    reply_id=self.id,
                    frames=self.pacer.frames_sent,
                    samples=self.pacer.samples_sent,
                    timings=self.timings(),
                )
            )

    def drop_pending(self, reason: str) -> int:
        """Count (and drop) every frame produced but not sent."""
        dropped = self.frames_produced - self.pacer.frames_sent
        if self.framer.clear():
            dropped += 1
        self.s.rt.metrics.frames_dropped.labels(reason).inc(dropped)
        return dropped

    def remember_heard(self, played_ms: float | None = None) -> str:
        """Put what the listener heard of this reply so far into the conversation (once)."""
        played_ms = self.pacer.played_ms() if played_ms is None else played_ms
        heard = self.heard.heard(int(played_ms * OUTPUT_RATE / 1000))
        self._remember(heard)
        return heard

    def _remember(self, text: str) -> None:
        if not (self.turn.say or self._remembered):
            self.s.conversation.add_assistant(text)
        self._remembered = True

    async def interrupted(self, reason: str) -> None:
        s = self.s
        dropped = self.drop_pending("interrupted")
        played_ms = self.pacer.played_ms()
        heard = self.remember_heard(played_ms)
        s.rt.metrics.underruns.inc(self.pacer.underruns)
        await s.emit(
            protocol.event(
                "audio.interrupted",
                reply_id=self.id,
                reason=reason,
                frames_sent=self.pacer.frames_sent,
                frames_dropped=dropped,
                played_ms=round(played_ms),
                heard_text=heard,
            )
        )


async def _one(text: str) -> AsyncIterator[str]:
    yield text
