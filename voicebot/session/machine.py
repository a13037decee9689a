"""One /v1/voice connection as a state machine: what the bot is doing, and what moves it on.

The session owns the tasks and the queues between the stages and decides what happens next;
the stages do the work (voicebot/session/listening.py, replying.py; the path and every bound:
docs/architecture.md). Input: typed commands through `handle` (voicebot.session.commands), each
wire message counted first by `arrived`. Output: typed events (voicebot.session.events) and
reply frames on the outbox, handed to the front end's `deliver` by `run_sender`. The session knows
no wire format: its front end (voicebot/frontends/) translates both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from enum import Enum
from typing import Awaitable, Callable

from voicebot import PROTOCOL_VERSION, protocol
from voicebot.asr.base import RecognizerStream
from voicebot.audio.echo import EchoCanceller
from voicebot.audio.loudness import OutputLevel
from voicebot.audio.rates import LISTEN_RATE, SPEAK_RATE
from voicebot.audio.resample import pcm16_to_float
from voicebot.channels import ChannelRefused
from voicebot.messages import AudioFrame, AudioIn, DropUtterance, Inbound, InputEnd, Turn
from voicebot.protocol import FRAME_MS, OUTPUT_SAMPLE_RATE, CloseCode, ErrorCode, ProtocolError
from voicebot.reply.history import Conversation
from voicebot.runtime import Runtime
from voicebot.serving.vad import VadOverloaded
from voicebot.session import commands, events
from voicebot.session.choices import Choices
from voicebot.session.commands import Command
from voicebot.session.events import Outbound
from voicebot.session.flood import FloodGuard
from voicebot.session.idle import IdleWatch
from voicebot.session.listening import FrontEnd, Listening
from voicebot.session.outbox import Outbox
from voicebot.session.replying import Reply, Replying
from voicebot.session.reset import EngineReset
from voicebot.session.turn_taking import TurnTaking
from voicebot.tts.base import SynthesisContext

log = logging.getLogger("voicebot.session")

# Queue bounds. audio_in: 64 chunks of at most 1 s each (the client's chunk size, typically
# 20-100 ms, so about 6 s of audio in practice). turns: 8 replies waiting to be made.
AUDIO_IN_MAX = 64
TURNS_MAX = 8
# The VAD batcher full: it drains in steps of milliseconds, so the client may send again soon.
VAD_RETRY_AFTER_S = 1


class State(Enum):
    STARTING = "starting"  # connected, waiting for session.start
    LISTENING = "listening"
    THINKING = "thinking"  # a reply is being prepared, no audio sent yet
    SPEAKING = "speaking"
    CLOSING = "closing"


# Every move the session may make; any other is a bug and raises.
TRANSITIONS: dict[State, set[State]] = {
    State.STARTING: {State.LISTENING, State.CLOSING},
    State.LISTENING: {State.THINKING, State.CLOSING},
    State.THINKING: {State.SPEAKING, State.LISTENING, State.CLOSING},
    State.SPEAKING: {State.LISTENING, State.CLOSING},
    State.CLOSING: set(),
}


# The front end's side of the outbox: puts one event or frame on its wire (voicebot/frontends/).
Deliver = Callable[[Outbound], Awaitable[None]]


class Session:
    def __init__(self, runtime: Runtime, deliver: Deliver) -> None:
        self.rt = runtime
        self.settings = runtime.settings
        self._deliver = deliver
        self.id = uuid.uuid4().hex
        # The key of this session's conversation in the resume store: sent only to this client (in
        # session.ready, never to a channel's listeners), so no one else can take the conversation.
        self.resume_token = secrets.token_urlsafe(24)
        self.state = State.STARTING
        self.sample_rate = LISTEN_RATE
        self.choices = Choices(runtime.default_responder, self.settings.pacing.barge_in_min_ms)
        self.conversation = Conversation(self.settings.reply.max_history_turns, self.settings.reply.max_history_tokens)
        limits = self.settings.limits
        self.flood = FloodGuard(limits.max_messages_per_s, limits.max_audio_realtime_factor, limits.window_s)
        self.close_request: tuple[int, str, str] | None = None  # (close code, error code, reason)
        self.close_requested = asyncio.Event()
        self.idle = IdleWatch(self.settings.server.idle_timeout_s, busy=lambda: self.replying)

        self.outbox = Outbox(runtime.metrics)
        self.audio_in: asyncio.Queue[Inbound] = asyncio.Queue(AUDIO_IN_MAX)
        self.turns: asyncio.Queue[Turn] = asyncio.Queue(TURNS_MAX)
        self._tasks: list[asyncio.Task] = []
        self._reply_task: asyncio.Task | None = None
        self._reply: Reply | None = None
        self.last_reply: Reply | None = None  # the latest reply, playing or done: a client may still truncate it
        self._engine_lock = asyncio.Lock()  # held per audio chunk, to start a reply and by a reset
        self.asr: RecognizerStream | None = None  # this session's engine state, from session.start on
        self.tts: SynthesisContext | None = None
        self.listening: Listening | None = None
        self.replies: Replying | None = None
        self.turn_taking: TurnTaking | None = None
        self.echo: EchoCanceller | None = None
        self._wants_smart = self.settings.endpoint.turn == "smart"
        self._silence_ms = self.settings.endpoint.endpoint_silence_ms  # the silence rule's wait
        self.engine_reset: EngineReset | None = None

    def _enter(self, state: State) -> None:
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"session {self.id[:8]}: no transition from {self.state.value} to {state.value}")
        self.state = state

    # ---- lifecycle ------------------------------------------------------------------------

    @property
    def replying(self) -> bool:
        """A reply is being made or played, or one is queued."""
        return self._reply is not None or not self.turns.empty()

    async def run_sender(self) -> None:
        """Hand the outbox to the front end, in order; a None entry ends it."""
        while (message := await self.outbox.get()) is not None:
            if self.echo is not None and isinstance(message, AudioFrame):
                self.echo.play(pcm16_to_float(message.pcm))  # the far end: what the client is about to play
            await self._deliver(message)

    async def close(self) -> None:
        """Release every task, queue and engine state of this session (idempotent)."""
        if self.state is State.CLOSING:
            return
        self._enter(State.CLOSING)
        self.rt.channels.leave(self.id)
        reply = self._reply  # cancelling the speak task clears self._reply
        if self._reply_task:
            self._reply_task.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for t in [self._reply_task] if t), return_exceptions=True)
        if self.turn_taking is not None:
            await self.turn_taking.close()
        if self.echo is not None and self.echo.attenuation_db is not None:
            self.rt.metrics.echo_attenuation.observe(self.echo.attenuation_db)
        if reply is not None:
            reply.drop_pending("client_gone")
            reply.remember_heard()  # a client that resumes finds what it heard of this reply
        self.rt.conversations.release(self.resume_token)
        for engine_state in (self.asr, self.tts):
            if engine_state is not None:
                with contextlib.suppress(Exception):
                    await engine_state.close()
        self.asr = self.tts = None
        while not self.audio_in.empty():
            self.audio_in.get_nowait()

    # ---- input ----------------------------------------------------------------------------

    def arrived(self, audio_bytes: int = 0) -> bool:
        """One message came from the client, holding `audio_bytes` of audio: every front end calls
        this once per wire message, before handing its commands (or answering it itself). It counts
        for the idle timeout and the flood guard. False: drop the message (it floods, or the session
        is closing); its audio is counted as dropped."""
        self.idle.heard()
        # A frame over the frame limit counts as that limit for the flood guard: it is refused with
        # frame_too_large (_hear), not taken for a flood (a 256 KB frame at 16 kHz would empty the
        # audio allowance at once); frames that keep coming still flood it.
        return not self._flooding(min(audio_bytes, protocol.audio_frame_limit(self.sample_rate)))

    async def _hear(self, data: bytes) -> None:
        """An AudioChunk: checked, recorded if recording is on, queued for the listen task."""
        if self.state is State.STARTING:
            await self.outbox.error(ErrorCode.NOT_STARTED, "audio before session.start: send session.start first")
            return
        if not data:
            return  # an empty frame carries nothing
        try:
            protocol.check_audio(len(data), self.sample_rate)
        except ProtocolError as exc:
            self._drop_input(len(data) & ~1, exc.code)  # not heard: counted, as all dropped input is
            await self.outbox.error(exc.code, exc.message)
            return
        self.rt.input_recorder.record(self.id, self.sample_rate, data)
        await self.audio_in.put(AudioIn(data, time.monotonic()))

    def _flooding(self, audio_bytes: int) -> bool:
        """True: this message is refused (it floods, or the session is closing). Its audio is
        counted as dropped, as every piece of input the server does not hear is."""
        if self.close_request:
            self._drop_input(audio_bytes, "closing")
            return True
        reason = self.flood.check(audio_bytes, self.sample_rate)
        if reason:
            self._drop_input(audio_bytes, "flooding")
            self.request_close(CloseCode.FLOODING, ErrorCode.FLOODING, f"flooding: {reason}")
        return reason is not None

    def _drop_input(self, audio_bytes: int, reason: str) -> None:
        if audio_bytes:
            self.rt.metrics.input_dropped.labels(reason).inc(audio_bytes / (2 * self.sample_rate))

    def request_close(self, close_code: int, error_code: str, reason: str) -> None:
        """Ask the connection's owner (voicebot.app.run_session) to send the error and close."""
        if self.close_request is None:
            self.close_request = (close_code, error_code, reason)
            self.close_requested.set()

    async def expect_start(self, timeout_s: float) -> None:
        """Close a connection that has not sent session.start within `timeout_s`: an idle one
        would hold a max_sessions place for ever."""
        await asyncio.sleep(timeout_s)
        if self.state is State.STARTING:
            self.request_close(CloseCode.POLICY, ErrorCode.START_TIMEOUT, f"no session.start within {timeout_s:g} s")

    async def _close_when_idle(self) -> None:
        """From session.start on: close the session once its client has gone quiet (session/idle.py)."""
        self.request_close(CloseCode.POLICY, ErrorCode.IDLE_TIMEOUT, await self.idle.expire())

    async def handle(self, message: Command) -> None:
        """The session's typed door in: one command (a parsed /v1/voice message, or one a front end
        built: voicebot.session.commands), in the order the client sent it."""
        if isinstance(message, commands.AudioChunk):
            await self._hear(message.pcm)
        elif isinstance(message, protocol.SessionStart):
            if self.state is not State.STARTING:
                await self.outbox.error(ErrorCode.ALREADY_STARTED, "session.start was already received")
                return
            await self._start(message)
        elif self.state is State.STARTING and not isinstance(message, protocol.Ping):
            await self.outbox.error(ErrorCode.NOT_STARTED, f"{_name(message)} before session.start: send session.start first")
        elif isinstance(message, protocol.SessionUpdate):
            await self._update(message)
        elif isinstance(message, protocol.EndInput):
            await self.audio_in.put(InputEnd(time.monotonic()))  # in order with the audio before it
        elif isinstance(message, commands.ClearInput):
            await self.audio_in.put(DropUtterance())  # in order with the audio before it: answered by input.cleared
        elif isinstance(message, protocol.Say):
            if message.interrupt:
                await self.interrupt("say")
            await self._queue_turn(Turn(message.text, say=True))
        elif isinstance(message, commands.AnswerText):
            await self._queue_turn(Turn(message.text, say=False))
        elif isinstance(message, protocol.Interrupt):
            await self.interrupt("client")
        elif isinstance(message, commands.TruncateReply):
            await self._truncate(message)
        elif isinstance(message, commands.SetInstructions):
            self.conversation.instructions = message.text
        elif isinstance(message, commands.SetVadThreshold):
            self._set_vad_threshold(message.threshold)
        elif isinstance(message, protocol.Ping):
            await self.outbox.emit(events.Pong(message.id))
        else:
            raise TypeError(f"not a session command: {message!r}")

    async def _start(self, message: protocol.SessionStart) -> None:
        try:
            self._apply_choices(message)
            self.tts = self.rt.synthesizer.open(message.voice)
        except ProtocolError as exc:
            await self.outbox.error(exc.code, exc.message)
            return
        self.sample_rate = message.sample_rate
        self.asr = self.rt.recognizer.open(self.choices.language)
        if message.echo_cancellation:  # /obs/audio asks for it (voicebot/frontends/obs_plugin.py)
            self.echo = EchoCanceller()
        front_end = FrontEnd(self.sample_rate, self.settings.gate, self.settings.endpoint, self.echo, vad=self.rt.vad)
        self.listening = Listening(front_end, self.asr, self.rt.audio_worker, self.rt.metrics, self.outbox, self.id,
                                   self.rt.input_lag)
        self.turn_taking = TurnTaking(self.settings.endpoint, None, front_end, self.outbox, self.rt.metrics,
                                      self._queue_turn, self._prepare_reply)
        self.listening.on_endpoint = self.turn_taking.on_endpoint
        self._set_turn(message.endpointing)
        self._enter(State.LISTENING)
        resumed = await self._resume(message.resume)
        refused = await self._claim(message.channel, message.resume if resumed else None)
        self.replies = Replying(self.tts, self.conversation, self.outbox, self.rt.metrics, self.rt.speech_filter,
                                 self.settings.reply, self.settings.pacing,
                                 level=OutputLevel(SPEAK_RATE, self.settings.output))
        self.engine_reset = EngineReset(self.settings.reset.interval_s, self.asr, self.tts, self.rt.metrics, self.outbox)
        await self.outbox.emit(events.SessionReady(self.id, self.resume_token, PROTOCOL_VERSION, self.sample_rate, OUTPUT_SAMPLE_RATE,
                                                   FRAME_MS, self.tts.voice, self.choices.responder, resumed))
        if refused is not None:
            await self.outbox.error(refused.code, refused.message)
        self._tasks = [
            asyncio.create_task(self._listen(), name=f"listen-{self.id[:8]}"),
            asyncio.create_task(self._speak(), name=f"speak-{self.id[:8]}"),
            asyncio.create_task(self._reset_timer(), name=f"reset-{self.id[:8]}"),
            asyncio.create_task(self._close_when_idle(), name=f"idle-{self.id[:8]}"),
        ]

    async def _resume(self, resume_token: str | None) -> bool:
        """Take over the conversation a previous session's resume token names, if the store still has
        it (a client back before its old socket was seen closed takes it from the live session: only
        that client was ever told the token); register ours under our own token."""
        conversation = await self.rt.conversations.take(resume_token) if resume_token else None
        if conversation is not None:
            holder = next((s for s in self.rt.sessions.values() if s is not self and s.resume_token == resume_token), None)
            if holder is not None:  # taken from a session still live here: one conversation, one live session
                conversation = conversation.copy()
                holder.lose_conversation()
            self.conversation = conversation
        self.rt.conversations.register(self.resume_token, self.conversation)
        return conversation is not None

    def lose_conversation(self) -> None:
        """Another session resumed this one's conversation with its resume token and took a copy:
        this one's is emptied (its replies, one in progress too, write only there, and nothing can
        resume it), and its client is told."""
        self.conversation.clear()
        # Told from its own task: the resuming session does not wait on this one's outbox.
        self._tasks.append(asyncio.create_task(self.outbox.error(ErrorCode.CONVERSATION_LOST, CONVERSATION_LOST_MESSAGE)))

    async def _claim(self, channel: str | None, resumed_from: str | None) -> ChannelRefused | None:
        """Speak on the channel named in session.start, if any; why not, when the session may not."""
        if not channel:
            return None
        try:
            await self.rt.channels.claim(channel, self.id, owner=self.resume_token, resumed_from=resumed_from,
                                         tell=self.outbox.error)
        except ChannelRefused as exc:
            return exc
        return None

    def _apply_choices(self, message: protocol.SessionStart | protocol.SessionUpdate) -> None:
        self.choices.apply(message.voice, message.responder, message.language, message.endpointing,
                           self.rt.synthesizer.voices(), self.rt.responders)

    async def _update(self, message: protocol.SessionUpdate) -> None:
        try:
            self._apply_choices(message)
        except ProtocolError as exc:
            await self.outbox.error(exc.code, exc.message)
            return
        if message.voice is not None:
            self.tts.set_voice(message.voice)
        self._set_turn(message.endpointing)
        await self.outbox.emit(events.SessionUpdated(
            voice=self.tts.voice,
            responder=self.choices.responder,
            language=self.choices.language,
            turn="smart" if self.turn_taking.smart else "silence",
            endpoint_silence_ms=self._silence_ms,
            barge_in_min_ms=self.choices.barge_in_min_ms,
        ))

    def _set_turn(self, endpointing: protocol.EndpointingUpdate | None) -> None:
        """What ends this session's turns: the server's `endpoint.turn`, or the client's choice (an
        endpoint_silence_ms alone asks for the silence rule with that wait)."""
        if endpointing is not None and endpointing.endpoint_silence_ms:
            self._silence_ms = endpointing.endpoint_silence_ms
            self._wants_smart = False
        if endpointing is not None and endpointing.turn:
            self._wants_smart = endpointing.turn == "smart"
        smart = self.rt.smart_turn if self._wants_smart else None  # None too where the model did not load
        self.turn_taking.use(smart)
        # smart: the endpointer ends a segment at the short pause where the model is asked.
        pause_ms = self.settings.endpoint.smart_pause_ms if smart else self._silence_ms
        self.listening.front_end.endpointer.set_silence_ms(pause_ms)

    def _set_vad_threshold(self, threshold: float) -> None:
        endpointer = self.listening.front_end.endpointer  # the stage's config, set as _set_turn sets its pause
        endpointer.config = endpointer.config.model_copy(update={"threshold": threshold})

    # ---- listen: audio in, utterances out, barge-in ------------------------------------------

    async def _listen(self) -> None:
        held: Inbound | None = None  # taken from the queue behind a run of chunks: the next item
        while True:
            if held is not None:
                item, held = held, None
            else:
                item = await self.turn_taking.next_input(self.audio_in)  # a stalled client: an InputEnd of its own
            if isinstance(item, AudioIn):
                # Every chunk already waiting goes with it, in one trip through the front end, the
                # VAD and the recognizer: a session that fell behind catches up at once, where one
                # trip per chunk would keep it behind (docs/serving.md, capacity and admission).
                item, held = await self._waiting_chunks(item)
            if isinstance(item, DropUtterance):
                async with self._engine_lock:
                    utterance_id = await self.listening.clear()
                await self.outbox.emit(events.InputCleared(utterance_id))
                continue
            async with self._engine_lock:
                try:
                    utterances = await self.listening.hear(item)
                except Exception as exc:  # the front end or the VAD batcher (VadFault, JobAborted) broke on this chunk
                    await self._front_end_failed(item, exc)
                    continue
                for utterance in utterances:
                    await self.turn_taking.on_utterance(utterance, input_end=isinstance(item, InputEnd))
                if isinstance(item, InputEnd):
                    await self.turn_taking.end_now()  # input.end with no utterance open: a turn may still be
                else:
                    await self.turn_taking.after_chunk(self.listening.front_end.silence_ms)
            # While the reply is still being prepared too: the user has more to say.
            if self.state in (State.THINKING, State.SPEAKING) and self.listening.speech_run_ms >= self.choices.barge_in_min_ms:
                await self.interrupt("barge_in")

    async def _waiting_chunks(self, first: AudioIn) -> tuple[list[AudioIn], Inbound | None]:
        """`first` and the chunks queued after it, up to the first other input (returned apart).
        Taken through next_input, which notes each chunk's arrival, and which never waits on a
        queue that holds something."""
        chunks: list[AudioIn] = [first]
        while not self.audio_in.empty():
            item = await self.turn_taking.next_input(self.audio_in)
            if not isinstance(item, AudioIn):
                return chunks, item
            chunks.append(item)
        return chunks, None

    async def _front_end_failed(self, item: Inbound | list[AudioIn], exc: Exception) -> None:
        """A chunk the front end failed on, or the VAD batcher had no room for, is lost, and so is
        the utterance it was part of: the client is told, both are counted as dropped input, and the
        next utterance is heard afresh. An overload is the server's capacity, not a broken engine:
        `busy` with a retry-after, as admission answers, counted apart."""
        overloaded = isinstance(exc, VadOverloaded)
        reason = "overload" if overloaded else "engine_error"
        if overloaded:
            log.warning("the VAD batcher is full; a chunk of session %s is dropped: %s", self.id, exc)
            self.rt.metrics.engine_overloads.labels("vad").inc()
        else:
            log.error("the front end failed on a chunk in session %s", self.id, exc_info=exc)
            self.rt.metrics.engine_failures.labels("vad", "chunk").inc()
        utterance_id = await self.listening.lose_open(reason)
        chunk_s = sum(len(c.pcm) for c in item) / (2 * self.sample_rate) if isinstance(item, list) else 0.0
        self.rt.metrics.input_dropped.labels(reason).inc(chunk_s)
        lost = f"; utterance {utterance_id} is lost" if utterance_id else ""
        where = {"engine": "vad", "stage": "chunk", **({"utterance_id": utterance_id} if utterance_id else {})}
        if overloaded:
            await self.outbox.error(ErrorCode.BUSY, f"voice detection is at capacity; a chunk of input was dropped{lost}",
                                    retry_after_s=VAD_RETRY_AFTER_S, overloaded="vad", **where)
        else:
            await self.outbox.error(ErrorCode.ENGINE_ERROR, f"voice detection failed on a chunk of input{lost}: {exc}", **where)

    def _prepare_reply(self, turn: Turn) -> Reply | None:
        """A reply started during a pause, held until the turn is decided (turn_taking.py); none
        while another reply is made or played (it would share the session's TTS)."""
        if self.replying or self.state is not State.LISTENING:
            return None
        name = self.choices.responder
        reply = self.replies.reply(turn, name, self.rt.responders[name], on_speaking=lambda: self._enter(State.SPEAKING))
        reply.prepare()
        return reply

    async def _queue_turn(self, turn: Turn) -> None:
        if self.turns.full():
            await self.outbox.error(ErrorCode.ENGINE_ERROR, "too many replies queued; this one is dropped", dropped_text=turn.text)
            return
        await self.turns.put(turn)

    # ---- speak: turns in, one reply at a time --------------------------------------------------

    async def _speak(self) -> None:
        while True:
            turn = await self.turns.get()
            # The lock only makes a reply wait for a reset in progress. Held for the whole reply,
            # it stopped _listen for that long, so barge-in could never happen; the reset timer
            # checks self._reply under the lock instead.
            async with self._engine_lock:
                self._enter(State.THINKING)
                name = self.choices.responder
                reply = self.turn_taking.claim(turn) or self.replies.reply(
                    turn, name, self.rt.responders[name], on_speaking=lambda: self._enter(State.SPEAKING))
                self._reply = self.last_reply = reply
                self._reply_task = asyncio.create_task(reply.run(), name=f"reply-{self.id[:8]}")
            try:
                await self._reply_task
            except asyncio.CancelledError:
                if self.state is State.CLOSING:
                    raise
            finally:
                self._reply = self._reply_task = None
                self.rt.reply_ended()  # a SIGTERM drain waits on this (app.py)
                if self.state is not State.CLOSING:
                    self._enter(State.LISTENING)

    async def interrupt(self, reason: str, played_ms: float | None = None) -> None:
        """Stop the reply in progress at once and drop everything queued for it; `played_ms`: what
        the client says it played of it (/v1/realtime's truncate), else the pacer's count."""
        reply, task = self._reply, self._reply_task
        if reply is None or task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self.echo is not None:
            self.echo.stop()  # the client drops what it has not played
        await reply.cancel(reason, played_ms)

    async def _truncate(self, message: commands.TruncateReply) -> None:
        reply = self.last_reply
        if reply is None or reply.id != message.reply_id:
            await self.outbox.emit(events.TruncateRefused(message.reply_id))
            return
        # A no-op if it has ended; otherwise it stops here, its audio.interrupted reporting what was played.
        await self.interrupt("client", played_ms=message.audio_end_ms)
        await self.outbox.emit(events.ReplyTruncated(reply.id, message.audio_end_ms, reply.truncate(message.audio_end_ms)))

    # ---- periodic reset ---------------------------------------------------------------------

    async def _reset_timer(self) -> None:
        while True:
            await asyncio.sleep(self.engine_reset.check_every_s)
            # Only at a turn boundary: nothing being said by either side.
            if (not self.engine_reset.due or self._reply is not None or self.listening.in_utterance
                    or self.turn_taking.open or not self.turns.empty()):
                continue
            async with self._engine_lock:
                if self._reply is None and not self.listening.in_utterance and not self.turn_taking.open:
                    await self.engine_reset.run("periodic")


CONVERSATION_LOST_MESSAGE = (
    "another session resumed this conversation with this session's resume token and holds it now; this session goes "
    "on with an empty conversation that cannot be resumed. If the other session is your own client, close this "
    "one; if not, your resume token is known to someone else: start a new session without it")



def _name(command: Command) -> str:
    """A command as an error message names it: its /v1/voice type, else its class."""
    return command.type if isinstance(command, protocol.ClientCommand) else type(command).__name__
