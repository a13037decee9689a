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
from typing import Awaitable, Callable

from voicebot import PROTOCOL_VERSION, protocol
from voicebot.asr.base import RecognizerStream
from voicebot.audio.echo import EchoCanceller
from voicebot.audio.loudness import OutputLevel
from voicebot.audio.rates import LISTEN_RATE, SPEAK_RATE
from voicebot.audio.resample import pcm16_to_float
from voicebot.messages import AudioFrame, AudioIn, DropUtterance, Inbound, InputEnd, Turn
from voicebot.protocol import FRAME_MS, CloseCode, ErrorCode, ProtocolError
from voicebot.reply.history import Conversation
from voicebot.runtime import Runtime
from voicebot.serving.input_clock import INPUT_RETRY_AFTER_S
from voicebot.session import commands, events
from voicebot.session.choices import Choices
from voicebot.session.client_watch import ClientWatch
from voicebot.session.commands import Command
from voicebot.session.events import Outbound
from voicebot.session.input_loss import lose_chunks
from voicebot.session.listening import FrontEnd, Listening
from voicebot.session.outbox import Outbox
from voicebot.session.ownership import CONVERSATION_LOST_MESSAGE, claim_channel, resume
from voicebot.session.replying import Reply, Replying
from voicebot.session.reset import EngineReset
from voicebot.session.states import State, moved
from voicebot.session.turn_mode import TurnMode
from voicebot.session.turn_taking import TurnTaking
from voicebot.tts.base import SynthesisContext

log = logging.getLogger("voicebot.session")

# Queue bounds. audio_in: 64 chunks of at most 1 s each (the client's chunk size, typically
# 20-100 ms, so about 6 s of audio in practice). turns: 8 replies waiting to be made.
AUDIO_IN_MAX = 64
TURNS_MAX = 8


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
        self.watch = ClientWatch(self.settings, runtime.metrics, busy=lambda: self.replying)

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
        self.turn_mode: TurnMode | None = None
        self.engine_reset: EngineReset | None = None

    def _enter(self, state: State) -> None:
        self.state = moved(self.state, state)  # any move session/states.py does not list raises

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
        return self.watch.arrived(audio_bytes, self.sample_rate)

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
            self.watch.dropped(len(data) & ~1, self.sample_rate, exc.code)  # not heard: counted, as all dropped input is
            await self.outbox.error(exc.code, exc.message)
            return
        self.rt.input_recorder.record(self.id, self.sample_rate, data)
        await self.audio_in.put(AudioIn(data, time.monotonic()))

    def request_close(self, close_code: int, error_code: str, reason: str) -> None:
        """Ask the connection's owner (voicebot.frontends.run.run_session) to send the error and close."""
        self.watch.request_close(close_code, error_code, reason)

    async def expect_start(self, timeout_s: float) -> None:
        """Close a connection that has not sent session.start within `timeout_s`: an idle one
        would hold a max_sessions place for ever."""
        await asyncio.sleep(timeout_s)
        if self.state is State.STARTING:
            self.request_close(CloseCode.POLICY, ErrorCode.START_TIMEOUT, f"no session.start within {timeout_s:g} s")

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
            self.turn_mode.set_vad_threshold(message.threshold)
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
        front_end = FrontEnd(self.sample_rate, self.settings.gate, self.settings.endpoint, self.echo)
        self.listening = Listening(front_end, self.asr, self.rt.input_clock, self.rt.metrics, self.outbox, self.id,
                                   self.rt.input_lag)
        self.turn_taking = TurnTaking(self.settings.endpoint, None, front_end, self.outbox, self.rt.metrics,
                                      self._queue_turn, self._prepare_reply)
        self.listening.on_endpoint = self.turn_taking.on_endpoint
        self.turn_mode = TurnMode(self.settings.endpoint, self.rt.smart_turn, self.turn_taking, front_end.endpointer)
        self.turn_mode.apply(message.endpointing)
        self._enter(State.LISTENING)
        resumed = await resume(self.rt, self, message.resume)
        refused = await claim_channel(self.rt, self, message.channel, message.resume if resumed else None)
        self.replies = Replying(self.tts, self.conversation, self.outbox, self.rt.metrics, self.rt.speech_filter,
                                 self.settings.reply, self.settings.pacing,
                                 level=OutputLevel(SPEAK_RATE, self.settings.output))
        self.engine_reset = EngineReset(self.settings.reset.interval_s, self.asr, self.tts, self.rt.metrics, self.outbox)
        await self.outbox.emit(events.SessionReady(self.id, self.resume_token, PROTOCOL_VERSION, self.sample_rate, SPEAK_RATE,
                                                   FRAME_MS, self.tts.voice, self.choices.responder, resumed))
        if refused is not None:
            await self.outbox.error(refused.code, refused.message)
        self._tasks = [
            asyncio.create_task(self._listen(), name=f"listen-{self.id[:8]}"),
            asyncio.create_task(self._speak(), name=f"speak-{self.id[:8]}"),
            asyncio.create_task(self._reset_timer(), name=f"reset-{self.id[:8]}"),
            asyncio.create_task(self.watch.close_when_idle(), name=f"idle-{self.id[:8]}"),
        ]

    def lose_conversation(self) -> None:
        """Another session resumed this one's conversation with its resume token and took a copy:
        this one's is emptied (its replies, one in progress too, write only there, and nothing can
        resume it), and its client is told."""
        self.conversation.clear()
        # Told from its own task: the resuming session does not wait on this one's outbox.
        self._tasks.append(asyncio.create_task(self.outbox.error(ErrorCode.CONVERSATION_LOST, CONVERSATION_LOST_MESSAGE)))

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
        self.turn_mode.apply(message.endpointing)
        await self.outbox.emit(events.SessionUpdated(
            voice=self.tts.voice,
            responder=self.choices.responder,
            language=self.choices.language,
            turn=self.turn_mode.name,
            endpoint_silence_ms=self.turn_mode.silence_ms,
            barge_in_min_ms=self.choices.barge_in_min_ms,
        ))

    # ---- listen: audio in, utterances out, barge-in ------------------------------------------

    async def _listen(self) -> None:
        while True:
            # The chunks waiting, together; a stalled client: an InputEnd of its own.
            item = await self.turn_taking.next_batch(self.audio_in)
            if isinstance(item, DropUtterance):
                async with self._engine_lock:
                    utterance_id = await self.listening.clear()
                await self.outbox.emit(events.InputCleared(utterance_id))
                continue
            async with self._engine_lock:
                try:
                    utterances = await self.listening.hear(item)
                except Exception as exc:  # the front end or the input clock (InputStepFailed, InputClockFault) broke on this chunk
                    await lose_chunks(item, exc, self.listening, self.outbox, self.rt.metrics, self.id, self.sample_rate,
                                      retry_after_s=INPUT_RETRY_AFTER_S)
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




def _name(command: Command) -> str:
    """A command as an error message names it: its /v1/voice type, else its class."""
    return command.type if isinstance(command, protocol.ClientCommand) else type(command).__name__
