"""What every connection shares: settings, the loaded engines, metrics, and the live sessions.

Built once per app (voicebot/app.py). A session takes from it only at its start the few things
each of its stages uses; no stage holds the runtime.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Protocol

from voicebot import memory
from voicebot.asr.base import Recognizer
from voicebot.audio.linear_echo import linear_canceller_problem
from voicebot.audio.turn import SmartTurn, SmartTurnUnavailable
from voicebot.channels import ChannelHub
from voicebot.cluster import CLUSTER_UNAVAILABLE, Cluster
from voicebot.cluster.conversations import RedisConversationStore
from voicebot.config import Settings
from voicebot.engines import build_recognizer, build_responders, build_synthesizer
from voicebot.input_recorder import InputRecorder
from voicebot.metrics import Metrics, register_input_cpu
from voicebot.models import fetch_all
from voicebot.reply.base import Responder
from voicebot.reply.resume import ConversationStore
from voicebot.reply.safety import SpeechFilter
from voicebot.serving.capacity import Admission, InputLag, ServerCpu
from voicebot.serving.input_clock import InputClock
from voicebot.serving.metrics import register_vad_metrics
from voicebot.serving.vad import VadBatcher
from voicebot.serving.worker import Worker
from voicebot.tts.base import Synthesizer


log = logging.getLogger("voicebot")


class Tells(Protocol):
    """Where a session's errors go (voicebot.session.outbox.Outbox), typed here so that runtime.py
    does not import session/, which imports it."""

    async def error(self, code: str, message: str, **details) -> None: ...


class LiveSession(Protocol):
    """What the runtime needs of a connected session (voicebot.session.Session)."""

    id: str
    outbox: Tells

    @property
    def replying(self) -> bool: ...

    async def close(self) -> None: ...

    def request_close(self, close_code: int, error_code: str, reason: str) -> None: ...


@dataclass
class Runtime:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    recognizer: Recognizer | None = None  # None until load()
    synthesizer: Synthesizer | None = None
    responders: dict[str, Responder] = field(default_factory=dict)
    default_responder: str = "echo"
    # Resampler, echo canceller, gate and Silero VAD for every live session, one job per tick, off the
    # event loop (voicebot/serving/input_clock.py).
    input_clock: InputClock = field(default_factory=InputClock)
    # Silero VAD for /funasr's segmenter and the transcription endpoint: their windows in shared
    # onnxruntime calls (voicebot/serving/vad.py).
    vad: VadBatcher = field(default_factory=VadBatcher)
    # Smart Turn v3.2, shared by every session (endpoint.turn: smart); None: the silence rule.
    smart_turn: SmartTurn | None = None
    turn_problem: str | None = None  # why smart turn is not in use although configured
    echo_problem: str | None = None  # why the recognizer hears AEC3's suppressed output (voicebot/audio/echo.py)
    sessions: dict[str, LiveSession] = field(default_factory=dict)
    ready: bool = False
    draining: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    started_at: float = field(default_factory=time.monotonic)
    channels: ChannelHub = field(init=False)
    input_recorder: InputRecorder = field(init=False)
    conversations: ConversationStore | RedisConversationStore = field(init=False)  # for sessions that resume
    cluster: Cluster | None = None  # shared state in Redis, when cluster.redis_url is set
    _notices: set[asyncio.Task] = field(default_factory=set)  # cluster error events being queued, one per session
    speech_filter: SpeechFilter = field(init=False)  # blocklist and max length of what is spoken
    admission: Admission | None = None  # the thread pools' load and the input lag; built by load()
    input_lag: InputLag | None = None  # every session's, per pool (voicebot/serving/capacity.py); built by load()
    # Set when a reply ends or a session leaves: what wait_until() wakes on to look again.
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Who else follows every session's outbound messages (the operator console, voicebot/console.py):
    # each is called with the session id and the typed event or frame (voicebot.session.events.Outbound,
    # typed `object` here: runtime.py does not import session/) as its sender hands it to its front
    # end, by `observe`. An observer must never wait: the session's sender is calling.
    observers: list[Callable[[str, object], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.input_recorder = InputRecorder(self.settings.server.record_input_s)
        reply = self.settings.reply
        if self.settings.cluster.redis_url:  # several servers: conversations and channels in Redis
            self.cluster = Cluster(self.settings, self.metrics)
            self.channels, self.conversations = self.cluster.channels, self.cluster.conversations
            self.cluster.link.on_change(self._cluster_changed)
        else:
            self.channels = ChannelHub(self.metrics, self.settings.server.max_listeners)
            self.conversations = ConversationStore(reply.resume_ttl_s, reply.resume_max_conversations)
        self.speech_filter = SpeechFilter.from_config(reply)

    def load(self) -> None:
        s = self.settings
        if s.server.download_models:
            fetch_all(s)
        self.recognizer = build_recognizer(s)
        self.synthesizer = build_synthesizer(s)
        self.responders = build_responders(s)
        self.default_responder = s.reply.engine
        self.vad.start()
        self.input_clock.start()
        for engine in (self.recognizer, self.synthesizer, *self.responders.values()):
            engine.load()
        self.recognizer.register_metrics(self.metrics.registry)
        self.synthesizer.register_metrics(self.metrics.registry)
        register_vad_metrics(self.metrics.registry, self.vad, self.input_clock)
        # The decoding children's CPU (pocketsphinx's processes), for the whole server's load.
        children = getattr(self.recognizer, "processes", [])
        pools = [self.input_clock, self.vad, *self.recognizer.workers(), *self.synthesizer.workers(),
                 ServerCpu(lambda: sum(child.busy_s for child in children))]
        self.input_lag = InputLag(s.limits.max_input_lag_s, self.metrics.input_lag, self.metrics.input_deadline_misses)
        self.admission = Admission(pools, s.limits.max_worker_load, self.input_lag, s.limits.cold_start_sessions,
                                   gil_threads=[self.input_clock.ident])
        register_input_cpu(self.metrics.registry, lambda: {
            "front_end": self.input_clock.front_end_busy_s, "vad": self.input_clock.vad_busy_s + self.vad.busy_s,
            "asr": sum(pool.busy_s for pool in self.recognizer.workers())})
        if s.endpoint.turn == "smart":
            try:
                self.smart_turn = SmartTurn()
            except SmartTurnUnavailable as exc:
                self.turn_problem = str(exc)
                log.warning("endpoint.turn is smart but the end-of-turn model cannot be used (%s): "
                            "turns end by the silence rule (%d ms)", exc, s.endpoint.endpoint_silence_ms)
            else:
                self.admission.watch_pool(self.smart_turn.worker)  # every session's pauses ask it: a pool like the others
        self.echo_problem = linear_canceller_problem()
        if self.echo_problem:
            log.warning("echo cancellation: %s", self.echo_problem)
        # The VAD batcher is one thread of its own that outlives a failing batch; threads that die
        # and are replaced are the Workers' (voicebot/serving/worker.py): the pools', and those kept
        # out of admission (the end-of-turn model's, CosyVoice 2's voice derivations).
        watched = [*pools, getattr(self.synthesizer, "voice_worker", None), self.smart_turn and self.smart_turn.worker]
        self.metrics.watch_workers([pool for pool in watched if isinstance(pool, Worker)])
        # The engines' objects out of the cyclic GC's full collections, which would stop the loop for them.
        memory.freeze_startup_heap()
        self.ready = True

    @property
    def turn_mode(self) -> str:
        return "smart" if self.smart_turn is not None else "silence"

    async def start_cluster(self) -> None:
        """On the event loop, after load(): ClusterUnavailable stops start-up (a configured Redis must answer)."""
        if self.cluster is not None:
            await self.cluster.start()

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            await session.close()
        if self.cluster is not None:
            await self.cluster.close()  # after the sessions: their conversations reach Redis first
        for engine in (self.recognizer, self.synthesizer):
            if engine is not None:
                engine.close()
        for responder in self.responders.values():
            await responder.aclose()
        self.input_clock.stop()
        self.vad.stop()
        if self.smart_turn is not None:
            self.smart_turn.close()
        memory.thaw_heap()

    def replies_in_progress(self) -> int:
        return sum(1 for s in self.sessions.values() if s.replying)

    def reply_ended(self) -> None:
        self._changed.set()

    def observe(self, session_id: str, message: object) -> None:
        """One outbound message of a session, to every observer (frontends/run.py's sender)."""
        for observer in self.observers:
            observer(session_id, message)

    def session_left(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        self._changed.set()

    async def wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until done() holds, looking again each time a reply ends or a session leaves;
        False if timeout_s passed first."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not done():
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                return done()
        return True

    def _cluster_changed(self, up: bool) -> None:
        if up:
            return
        message = "lost the cluster's Redis: a reconnect may not find this conversation on another server"
        for session in list(self.sessions.values()):
            task = asyncio.ensure_future(session.outbox.error(CLUSTER_UNAVAILABLE, message))
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)
