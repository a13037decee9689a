"""The listening stage: a session's audio in, utterances out.

    AudioIn ─► FrontEnd (resample ─► echo canceller ─► gate ─► Silero VAD, on the input clock's
            thread with every session's chunks of the same tick (voicebot/serving/input_clock.py);
            endpoint rule) ─► VadEvents
            ─► Listening (recognizer stream; speech.started, asr.partial, asr.final) ─► Utterance

Two signals leave the echo canceller at the same sample positions (voicebot/audio/echo.py): the gate,
the VAD and the endpoint rule (so barge-in) get AEC3's suppressed output, where the echo is all but
gone; the audio the events carry, what the recognizer and the end-of-turn model hear, is the linear
canceller's, which keeps the start of words spoken over the bot (the suppressor took it off). The
gate's mutes apply to both.

`FrontEnd` owns its state and returns values, so nothing on the input clock's thread touches the
session. `Listening` runs on the event loop and returns
the `Utterance` of each endpoint; what to do with it (today: queue a Turn) is the session's
(Session._on_utterance), which is where a turn policy goes: an end-of-turn model asked at a short
pause sits between the endpoint events `hear` returns and the turn queue, without changing this.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from voicebot.asr.base import Hypothesis, RecognizerStream
from voicebot.audio.echo import EchoCanceller
from voicebot.audio.endpoint import WINDOW, Endpointer, EventKind, VadEvent
from voicebot.audio.gate import NoiseGate
from voicebot.audio.rates import LISTEN_RATE
from voicebot.audio.resample import StreamResampler, pcm16_to_float
from voicebot.config.stages import EndpointConfig, GateConfig
from voicebot.messages import AudioIn, InputEnd, Utterance
from voicebot.metrics import Metrics
from voicebot.protocol import ErrorCode
from voicebot.serving.capacity import InputLag
from voicebot.serving.input_clock import InputClock
from voicebot.serving.silero import SileroVad
from voicebot.session import events
from voicebot.audio.echo_onset import EchoOnset
from voicebot.session.outbox import Outbox

log = logging.getLogger("voicebot.session")

# Chunk arrival times kept to date the end of speech: 256 chunks, at least 5 s at the smallest
# chunk a client sends (20 ms); an utterance's end is always among the latest chunks.
ARRIVALS_MAX = 256
# soxr's medium quality for the mic: bench/resample.py (48 kHz in) measured it holding back 15.0 ms
# of a chunk against HQ's 21.3 ms, at 84 against 88 dB error below the signal in 4-7 kHz and 1
# against 1 Silero decision changed of 1,828; LQ (6.2 ms) costs 12.7 dB and 18 decisions.
MIC_RESAMPLER_QUALITY = "MQ"
# Input kept for the end-of-turn model, which reads the last 8 s of a turn (256 KB per session).
TURN_AUDIO_S = 8
@dataclass(frozen=True)
class FrontEndOutput:
    events: list[VadEvent]
    muted_samples: int  # of this chunk, at LISTEN_RATE


class FrontEnd:
    """Resample, gate and endpoint one session's input."""

    def __init__(self, input_rate: int, gate: GateConfig, endpoint: EndpointConfig, echo: EchoCanceller | None = None) -> None:
        self.input_rate = input_rate
        self.resampler = StreamResampler(input_rate, LISTEN_RATE, quality=MIC_RESAMPLER_QUALITY)
        self.echo = echo  # the bot's own voice removed before anything listens (voicebot/audio/echo.py)
        self.gate = NoiseGate(gate, LISTEN_RATE) if gate.enabled else None
        self.endpointer = Endpointer(endpoint)
        self.echo_onset = None if echo is None else EchoOnset()
        self._input_samples = 0  # at input_rate
        self._recent: deque[np.ndarray] = deque()  # the last TURN_AUDIO_S of what the recognizer hears
        self._recent_samples = 0
        self._fed = 0  # samples given to the endpointer: _recent ends there
        # Input in the gate, not yet out (at most its lookahead and one block, ~55 ms): the
        # suppressed signal it was given, and the recognizer's at the same positions.
        self._in_gate = np.zeros(0, np.float32)
        self._heard_in_gate = np.zeros(0, np.float32)
        self.speech_start_sample = 0  # where the latest utterance began (its pre-speech audio included)
        self._utterance_end = 0  # where the latest utterance ended: the next one's audio starts after it
        # (end of a chunk in input_rate samples, when it arrived): when the user stopped talking,
        # even if the chunk waited in the session's input queue before it was processed. Counted
        # at the input, not after the resampler and the echo canceller, which hold part of a chunk
        # back: a sample's position in the stream is the same at every stage, its chunk is not.
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=ARRIVALS_MAX)

    async def process(self, chunks: AudioIn | Sequence[AudioIn], clock: InputClock) -> FrontEndOutput:
        """Consecutive chunks of input (one, or all that waited in the session's queue): the signal
        path and their windows' speech probabilities at the input clock's next tick, with every other
        session's, then the endpoint rule here on the loop (a few comparisons per window). A session
        that fell behind catches up in one trip, not one per chunk (see Listening.hear)."""
        chunks = [chunks] if isinstance(chunks, AudioIn) else chunks
        heard = await clock.hear(self, chunks)
        return FrontEndOutput(self._decide(heard.windows, heard.probabilities, heard.suppressing), heard.muted_samples)

    @property
    def silero(self) -> SileroVad:
        """This stream's Silero state, which the input clock steps."""
        return self.endpointer.vad

    def _decide(self, windows: np.ndarray, probabilities: np.ndarray, suppressing: np.ndarray) -> list[VadEvent]:
        """The endpoint rule, a window at a time so that each event's audio has its stream
        positions; that audio is then what the recognizer hears there, an utterance's consecutive
        audio joined (one array per chunk, as the endpointer gives it). An utterance that starts
        while the echo canceller suppresses may reach further back (EchoOnset)."""
        spans: list[tuple[VadEvent, int, int]] = []  # an event, where its audio starts and ends
        for k in range(len(windows)):
            hidden = None  # whether the echo canceller's suppressor hid this window (EchoOnset)
            if self.echo_onset is not None:
                self.echo_onset.observe(windows[k], bool(suppressing[k]))
                if suppressing[k]:
                    at = self.endpointer.samples_seen
                    hidden = [self.echo_onset.hid(self._kept(at, at + WINDOW))]
            for event in self.endpointer.decide(windows[k : k + 1], probabilities[k : k + 1], hidden):
                end = self.endpointer.samples_seen
                start = end - len(event.audio)
                if event.kind is EventKind.START:  # its pre-speech audio included
                    if self.echo_onset is not None:
                        start = self.echo_onset.start(start, end, self._utterance_end)
                    self.speech_start_sample = start
                if event.kind is EventKind.END:
                    self._utterance_end = end
                joins = event.kind is EventKind.AUDIO and spans and spans[-1][0].kind in (EventKind.START, EventKind.AUDIO)
                if joins:
                    spans[-1] = (spans[-1][0], spans[-1][1], end)
                else:
                    spans.append((event, start, end))
        return [replace(event, audio=self._kept(start, end)) if end > start else event for event, start, end in spans]

    def prepare(self, *chunks: AudioIn) -> tuple[np.ndarray, int, np.ndarray]:
        """Blocking (the input clock's thread): the chunks resampled, echo-cancelled and gated, cut in VAD
        windows; what the recognizer hears of them kept; for each window, whether the echo canceller
        suppressed when its chunk was processed. Chunk by chunk: the echo canceller matches
        each with the reply audio played when it arrived."""
        windows, muted, suppressing = [], 0, []
        for chunk in chunks:
            samples = pcm16_to_float(chunk.pcm)
            self._input_samples += len(samples)
            self._arrivals.append((self._input_samples, chunk.arrived))
            audio = heard = self.resampler.process(samples)
            if self.echo is not None:
                audio, heard = self.echo.process(audio, chunk.arrived)
            if self.gate is not None:
                muted_before = self.gate.muted_samples
                audio, heard = self._gate(audio, heard)
                muted += self.gate.muted_samples - muted_before
            self._keep(heard)
            windows.append(self.endpointer.cut(audio))
            suppressing.append(np.full(len(windows[-1]), self.echo is not None and self.echo.suppressing))
        return np.concatenate(windows), muted, np.concatenate(suppressing)

    def _gate(self, audio: np.ndarray, heard: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The gate decides on `audio`; `heard` is muted where it muted `audio`, and delayed as
        much. The gate only ever changes a sample by muting it: the samples it changed are its mutes."""
        gated = self.gate.process(audio)
        given = np.concatenate([self._in_gate, audio])
        heard = np.concatenate([self._heard_in_gate, heard])
        out = len(gated)
        self._in_gate, self._heard_in_gate = given[out:], heard[out:]
        return gated, np.where((gated == 0) & (given[:out] != 0), np.float32(0), heard[:out])

    def _keep(self, audio: np.ndarray) -> None:
        self._fed += len(audio)
        self._recent.append(audio)
        self._recent_samples += len(audio)
        while self._recent_samples - len(self._recent[0]) >= TURN_AUDIO_S * LISTEN_RATE:
            self._recent_samples -= len(self._recent.popleft())

    @property
    def silence_ms(self) -> float:
        return self.endpointer.silence_ms

    def audio_since(self, sample: int) -> np.ndarray:
        """What the recognizer heard from `sample` on, at most the last TURN_AUDIO_S (a copy).

        Called between chunks, on the loop: the input clock is not processing one then.
        """
        return self._kept(sample, self._fed)

    def _kept(self, start: int, end: int) -> np.ndarray:
        """What the recognizer hears from stream position `start` to `end`, as far as it is kept."""
        pieces, position = [], self._fed
        for piece in reversed(self._recent):
            if position <= start:
                break
            piece_start = position - len(piece)
            if piece_start < end:
                pieces.append(piece[max(0, start - piece_start) : end - piece_start])
            position = piece_start
        return np.concatenate(pieces[::-1]) if pieces else np.zeros(0, np.float32)

    def end(self) -> list[VadEvent]:
        """The client sent input.end: end the utterance now."""
        self._utterance_end = self.endpointer.samples_seen
        return self.endpointer.force_end()

    def time_of_sample(self, sample: int) -> float:
        """When this LISTEN_RATE sample of the input arrived: its chunk's arrival, less the
        input after it in that chunk (a client sends a chunk once its last sample is recorded)."""
        position = sample * self.input_rate / LISTEN_RATE
        for end, arrived in self._arrivals:
            if end >= position:
                return arrived - (end - position) / self.input_rate
        return time.monotonic()


@dataclass
class _OpenUtterance:
    id: str
    muted_samples: int = 0
    heard_samples: int = 0  # given to the recognizer, at LISTEN_RATE
    lost: str | None = None  # why it is lost (engine_error, overload, cleared): the rest of it is counted as dropped input


# What a lost utterance hands the turn policy: no words.
LOST = Hypothesis("", None, "lost")


class Listening:
    """Turns a session's input into utterances (see the module doc)."""

    def __init__(self, front_end: FrontEnd, asr: RecognizerStream, clock: InputClock, metrics: Metrics, outbox: Outbox,
                 session_id: str, input_lag: InputLag | None = None) -> None:
        self.front_end = front_end
        self.asr = asr
        self._input_lag = input_lag
        self._clock = clock
        self._metrics = metrics
        self._outbox = outbox
        self._session_id = session_id
        self._count = 0
        self._open: _OpenUtterance | None = None
        self.on_endpoint: Callable[[], None] | None = None  # called at each endpoint (the turn policy's)

    @property
    def speech_run_ms(self) -> float:
        """Consecutive speech right now: what barge-in is decided on."""
        return self.front_end.endpointer.speech_run_ms

    @property
    def in_utterance(self) -> bool:
        return self.front_end.endpointer.in_utterance

    async def hear(self, item: InputEnd | AudioIn | Sequence[AudioIn]) -> list[Utterance]:
        """Consecutive chunks (one, or every chunk that waited in the session's queue: one trip
        through the front end, the VAD and the recognizer for all of them), or input.end, in; the
        utterances they ended out, in order. Each chunk's input lag is then counted: the time from
        its arrival to here, where the recognizer has been fed with it."""
        chunks: Sequence[AudioIn] = []
        if isinstance(item, InputEnd):
            events = self.front_end.end()
        else:
            chunks = [item] if isinstance(item, AudioIn) else item
            out = await self.front_end.process(chunks, self._clock)
            if out.muted_samples:
                self._metrics.gate_muted.inc(out.muted_samples / LISTEN_RATE)
                if self._open is not None:
                    self._open.muted_samples += out.muted_samples
            events = out.events
        utterances = []
        for event in events:
            if (utterance := await self._on_event(event)) is not None:
                utterances.append(utterance)
        if chunks:
            self._heard(chunks)
        return utterances

    def _heard(self, chunks: Sequence[AudioIn]) -> None:
        now = time.monotonic()
        self._metrics.input_audio.inc(sum(len(c.pcm) for c in chunks) / (2 * self.front_end.input_rate))
        if self._input_lag is not None:
            self._input_lag.observe(getattr(self.asr, "pool", "asr"), self._session_id, [now - c.arrived for c in chunks])

    async def _on_event(self, event: VadEvent) -> Utterance | None:
        if event.kind is EventKind.START:
            self._count += 1
            self._open = _OpenUtterance(f"u{self._count}")
            await self._outbox.emit(events.SpeechStarted(self._open.id))
        if self._open is None:
            return None
        if event.kind is EventKind.END:
            opened, self._open = self._open, None
            if self.front_end.echo is not None:
                self._metrics.endpoint_held.observe(event.held_ms / 1000)
            if self.on_endpoint is not None:
                self.on_endpoint()  # before the recognizer's finish, so what waits on the pause overlaps it
            return await self._finish(event, opened)
        if self._open.lost:  # the rest of a lost utterance: the recognizer starts afresh at the next
            self._metrics.input_dropped.labels(self._open.lost).inc(len(event.audio) / LISTEN_RATE)
            return None
        self._open.heard_samples += len(event.audio)
        try:
            partial = await self.asr.accept(event.audio)
        except Exception as exc:  # a model failing on this input must not end the session
            await self._failed("feed", exc, self._open)
            return None
        if partial is not None:
            await self._outbox.emit(events.AsrPartial(self._open.id, partial))
        return None

    async def _failed(self, stage: str, exc: Exception, opened: _OpenUtterance) -> None:
        """The recognizer failed on this utterance: it is lost (no transcript, no turn), the client
        is told, and the stream is rebuilt, so the next utterance starts on a clean one."""
        log.error("recognizer failed (%s) in session %s, utterance %s", stage, self._session_id, opened.id, exc_info=exc)
        self._metrics.engine_failures.labels("asr", stage).inc()
        self._lose(opened, "engine_error")
        await self._outbox.error(ErrorCode.ENGINE_ERROR, f"the recognizer failed; utterance {opened.id} is lost: {exc}",
                                 engine="asr", stage=stage, utterance_id=opened.id)
        await self._reset_stream()

    async def lose_open(self, reason: str) -> str | None:
        """The front end failed on a chunk or was overloaded (Session._listen): the utterance in
        progress, if any, lost as one the recognizer failed on is (the rest of it unheard, no
        transcript, no turn); its id."""
        if self._open is None or self._open.lost:
            return None
        self._lose(self._open, reason)
        await self._reset_stream()
        return self._open.id

    async def clear(self) -> str | None:
        """The client cleared its input: the utterance in progress lost (counted as dropped input,
        `cleared`) and ended now, so what comes after starts a new one; its id."""
        utterance_id = await self.lose_open("cleared")
        self.front_end.end()  # its END dropped with it: no transcript, no turn
        self._open = None
        return utterance_id

    def _lose(self, opened: _OpenUtterance, reason: str) -> None:
        """What was heard of it so far counted as dropped input now, the rest as it comes (_on_event)."""
        opened.lost = reason
        self._metrics.input_dropped.labels(reason).inc(opened.heard_samples / LISTEN_RATE)

    async def _reset_stream(self) -> None:
        try:
            await self.asr.reset()
        except Exception:
            log.exception("the recognizer could not be reset after a failure; the next utterance tries it as it is")

    async def _finish(self, event: VadEvent, opened: _OpenUtterance) -> Utterance:
        endpoint_at = time.monotonic()
        speech_end = self.front_end.time_of_sample(event.speech_end_sample) if event.speech_end_sample else endpoint_at
        hyp = None
        if not opened.lost:
            try:
                hyp = await self.asr.finish()
            except Exception as exc:
                await self._failed("finish", exc, opened)
        utterance = Utterance(
            id=opened.id,
            hypothesis=hyp or LOST,
            speech_end=speech_end,
            speech_ms=event.speech_ms,
            gate_muted_ms=round(opened.muted_samples * 1000 / LISTEN_RATE),
            endpoint_delay_s=endpoint_at - speech_end,
            asr_final_s=time.monotonic() - endpoint_at,
        )
        if hyp is None:
            return utterance  # empty: the turn policy takes it for noise; the error said it was lost
        self._observe(utterance)
        await self._outbox.emit(events.AsrFinal(utterance.id, hyp.to_event(), utterance.gate_muted_ms, _timings(utterance)))
        log.info(json.dumps(self._log_record(utterance), ensure_ascii=False))
        return utterance

    def _observe(self, utterance: Utterance) -> None:
        m, hyp = self._metrics, utterance.hypothesis
        m.endpoint_delay.observe(utterance.endpoint_delay_s)
        m.asr_final.observe(utterance.asr_final_s)
        m.utterances.labels(hyp.model).inc()
        if hyp.fallback is not None:
            m.dialect_fallbacks.labels("dialect" if hyp.model == hyp.fallback.model else "primary").inc()
        if hyp.confidence is not None:
            m.asr_confidence.labels(hyp.model).observe(hyp.confidence)

    def _log_record(self, utterance: Utterance) -> dict:
        hyp = utterance.hypothesis
        return {
            "event": "utterance",
            "session": self._session_id,
            "utterance": utterance.id,
            "text": hyp.text,
            "model": hyp.model,
            "confidence": hyp.confidence,
            "fallback": hyp.to_event()["fallback"],
            "speech_ms": utterance.speech_ms,
            "gate_muted_ms": utterance.gate_muted_ms,
            **_timings(utterance),
        }


def _timings(utterance: Utterance) -> dict:
    return {
        "endpoint_delay_ms": round(utterance.endpoint_delay_s * 1000, 1),
        "asr_final_ms": round(utterance.asr_final_s * 1000, 1),
    }
