"""Endpointing: Silero VAD decides where speech starts and where the utterance ends.

The model (voicebot/serving/silero.py, beside its batcher voicebot/serving/vad.py) judges 16 kHz
float32 audio in 32 ms windows (512 samples); this module decides from its speech probabilities.

An utterance starts once `min_speech_ms` of speech has been heard (so a click or a cough that
slipped past the gate is not an utterance), and includes `pre_speech_ms` of audio before the first
speech window. It ends after `endpoint_silence_ms` of silence, or at `max_utterance_s`.
Memory bound: the pre-speech buffer plus one window.

Silero's recurrent state carries speech into the silence after it: the one to three windows after
the last word still score above the threshold. Counted as speech, they delayed every pause by
that much (the last speech window ended 54 ms after the true end at the median of
tests/turn_set.py, 87 ms at p95). A speech window no louder than the room (within QUIET_MARGIN_DB
of the level of the recent non-speech windows) has no speech energy of its own: when silence
follows, the silence is counted from the first of those, at most HANGOVER_WINDOWS_MAX back (now
12 / 26 ms after the true end). A dip inside a word still needs Silero to hear the rest of the
pause as silence: on the set, in digital silence and in room noise, no more mid-word ends than
before (bench/turn_offline.py, which measures both).

Silence the echo canceller made (issue 29): while the bot talks, the VAD hears AEC3's suppressed
output, and in a new reply's first seconds its suppressor can take half a second from inside words
said over the echo down to its floor; heard as the user's silence, that ended the utterance inside
them (two utterances, each half '' to the recognizer). A window the canceller says it hid
(`hidden`, voicebot/audio/echo_onset.py) is, inside an utterance, neither speech nor silence: the
silence is not counted on over it, for at most HELD_SILENCE_SHARE of endpoint_silence_ms in one
pause. The canceller cannot tell words it hid from echo it removed: once the user has stopped, the
echo alone is hidden just as well, so an utterance said over the echo ends that much later than its
silence alone would have ended it (each END says how much: `held_ms`, voicebot_endpoint_held_seconds
on /metrics; its speech end stays at the last word). The barge-in rule's `speech_run_ms` is left as Silero has it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import numpy as np

from voicebot.config.stages import EndpointConfig
from voicebot.serving.silero import SAMPLE_RATE, WINDOW, SileroVad

WINDOW_MS = WINDOW * 1000 / SAMPLE_RATE  # 32 ms
QUIET_MARGIN_DB = 6.0
# Silero's hangover is one to three windows; a longer quiet stretch it calls speech is someone
# speaking softly, which must not end the utterance early.
HANGOVER_WINDOWS_MAX = 3
# The room's level: an exponential average over non-speech windows, about 10 windows (320 ms).
ROOM_LEVEL_WEIGHT = 0.1
# Of endpoint_silence_ms, the most one pause inside an utterance may hold of windows the echo
# canceller hid, uncounted: what an utterance said over the echo ends late by, at most (224 ms at the
# default 500, on the window grid). A hole the suppressor makes inside words is bridged up to 1.5 times
# endpoint_silence_ms. The holes that split the words were ~0.5 s (the live captures; 480-512 ms of
# counted silence in tests/unit/test_echo.py's 240 and 300 ms cases); inside the words of 92 offline
# cases (bench/echo.py's rooms and replies, the test's reply at 60-300 ms, 1.25-2.5 s into it) Silero's
# longest silence run was 128 ms at the median, 384 at most. A bound of all of endpoint_silence_ms an
# utterance instead went to a first short hole, and held up to 480 ms after the words: an utterance
# the echo alone had begun ran on into the user's words (bench/echo.py --offline, 240 ms -6 dB: one
# utterance, transcribed as the reply's phrase).
HELD_SILENCE_SHARE = 0.5


class EventKind(Enum):
    START = "start"  # an utterance began; `audio` holds the pre-speech audio and speech so far
    AUDIO = "audio"  # audio inside the utterance
    END = "end"  # the utterance ended; `audio` is empty


@dataclass(frozen=True)
class VadEvent:
    kind: EventKind
    audio: np.ndarray
    # Stream position (samples since the stream began) of the end of the last speech window:
    # where the user stopped talking, the origin of every latency we report.
    speech_end_sample: int = 0
    speech_ms: float = 0.0
    # END: how much later than its silence alone would have ended it: the windows the echo canceller
    # hid after its last speech window, not counted as silence.
    held_ms: float = 0.0


class Endpointer:
    def __init__(self, config: EndpointConfig) -> None:
        self.config = config
        self.vad = SileroVad()
        self._partial = np.zeros(0, np.float32)
        self._preroll: deque[np.ndarray] = deque(maxlen=max(1, round(config.pre_speech_ms / WINDOW_MS)))
        self._pending: list[np.ndarray] = []  # speech heard before min_speech_ms was reached
        self.in_utterance = False
        self.samples_seen = 0
        self._speech_windows = 0  # speech windows in the current (tentative) utterance
        self._silence_windows = 0
        self._utterance_windows = 0
        self._last_speech_end = 0
        self._held_since_speech = 0  # hidden windows since the last speech window not counted as silence
        self._room_db: float | None = None  # the level of the recent non-speech windows
        self._quiet_speech = 0  # speech windows no louder than the room at the end of the speech so far
        # Consecutive speech windows right now: the barge-in detector reads it.
        self.speech_run_ms = 0.0

    @property
    def silence_ms(self) -> float:
        """Silence since the last speech window (0 while the user speaks), less the windows the echo
        canceller hid that were not counted as silence: what a turn policy reads."""
        return (self.samples_seen - self._last_speech_end - self._held_since_speech * WINDOW) * 1000 / SAMPLE_RATE

    def set_silence_ms(self, ms: int) -> None:
        self.config = self.config.model_copy(update={"endpoint_silence_ms": ms})

    def process(self, audio: np.ndarray) -> list[VadEvent]:
        """Cut, judge (this stream's windows one call each) and decide, in one go."""
        windows = self.cut(audio)
        return self.decide(windows, self.vad.probabilities(windows))

    def cut(self, audio: np.ndarray) -> np.ndarray:
        """The whole windows (k, WINDOW) that `audio` completes; the rest waits for the next chunk."""
        data = np.concatenate([self._partial, np.asarray(audio, np.float32)])
        n = len(data) // WINDOW
        self._partial = data[n * WINDOW :]
        return data[: n * WINDOW].reshape(n, WINDOW)

    def decide(self, windows: np.ndarray, probabilities: np.ndarray, hidden: Sequence[bool] | None = None) -> list[VadEvent]:
        """The endpoint rule over the windows `cut` returned and their speech probabilities
        (a few comparisons per window: cheap enough for the event loop); `hidden`: for each, whether
        the echo canceller took what it held to its floor (none: no canceller)."""
        events: list[VadEvent] = []
        for k, (window, probability) in enumerate(zip(windows, probabilities)):
            events.extend(self._window(window, probability, hidden is not None and bool(hidden[k])))
        return _merge_audio(events)

    def force_end(self) -> list[VadEvent]:
        """End the utterance now (the client sent input.end)."""
        if not self.in_utterance:
            self._reset_utterance()
            return []
        return [self._end()]

    def _window(self, window: np.ndarray, probability: float, hidden: bool) -> list[VadEvent]:
        speech = probability >= self.config.threshold
        held = (not speech and hidden and self.in_utterance
                and (self._held_since_speech + 1) * WINDOW_MS <= self.config.endpoint_silence_ms * HELD_SILENCE_SHARE)
        level_db = 10 * np.log10(float(np.dot(window, window)) / WINDOW + 1e-18)
        self.samples_seen += WINDOW
        self.speech_run_ms = self.speech_run_ms + WINDOW_MS if speech else 0.0
        if speech:
            quiet = self._room_db is not None and level_db < self._room_db + QUIET_MARGIN_DB
            self._quiet_speech = min(HANGOVER_WINDOWS_MAX, self._quiet_speech + 1) if quiet else 0
            self._speech_windows += 1
            self._silence_windows = 0
            self._last_speech_end = self.samples_seen
            self._held_since_speech = 0
        elif held:  # not the user's silence, nor the room's level: the silence so far stands
            self._held_since_speech += 1
        else:
            self._room_db = level_db if self._room_db is None else self._room_db + ROOM_LEVEL_WEIGHT * (level_db - self._room_db)
            if self._silence_windows == 0 and self._quiet_speech:  # the hangover was silence already
                self._silence_windows = self._quiet_speech
                self._last_speech_end -= self._quiet_speech * WINDOW
            self._quiet_speech = 0
            self._silence_windows += 1
        silence_ms = self._silence_windows * WINDOW_MS

        if self.in_utterance:
            self._utterance_windows += 1
            events = [VadEvent(EventKind.AUDIO, window)]
            too_long = self._utterance_windows * WINDOW_MS >= self.config.max_utterance_s * 1000
            if silence_ms >= self.config.endpoint_silence_ms or too_long:
                events.append(self._end())
            return events

        if self._speech_windows == 0:
            self._preroll.append(window)
            return []
        self._pending.append(window)
        if silence_ms >= self.config.endpoint_silence_ms:
            # A blip shorter than min_speech_ms: forget it, keep the latest audio as pre-roll.
            self._preroll.extend(self._pending)
            self._reset_utterance()
            return []
        if self._speech_windows * WINDOW_MS >= self.config.min_speech_ms:
            self.in_utterance = True
            self._utterance_windows = len(self._pending)
            audio = np.concatenate([*self._preroll, *self._pending])
            self._preroll.clear()
            self._pending = []
            return [VadEvent(EventKind.START, audio)]
        return []

    def _end(self) -> VadEvent:
        event = VadEvent(
            EventKind.END,
            np.zeros(0, np.float32),
            speech_end_sample=self._last_speech_end,
            speech_ms=self._speech_windows * WINDOW_MS,
            held_ms=self._held_since_speech * WINDOW_MS,
        )
        self._reset_utterance()
        return event

    def _reset_utterance(self) -> None:
        self.in_utterance = False
        self._pending = []
        self._speech_windows = 0
        self._silence_windows = 0
        self._utterance_windows = 0
        self._quiet_speech = 0  # (_held_since_speech runs on to the next speech: silence_ms stays continuous)


def _merge_audio(events: list[VadEvent]) -> list[VadEvent]:
    """Join consecutive AUDIO events so the recognizer gets one array per chunk, not per window."""
    merged: list[VadEvent] = []
    for ev in events:
        if ev.kind is EventKind.AUDIO and merged and merged[-1].kind in (EventKind.AUDIO, EventKind.START):
            last = merged[-1]
            merged[-1] = VadEvent(last.kind, np.concatenate([last.audio, ev.audio]))
        else:
            merged.append(ev)
    return merged
