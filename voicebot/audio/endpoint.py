"""Endpointing: Silero VAD decides where speech starts and where the utterance ends.

The model ships in the `silero-vad` wheel (silero_vad.onnx); one onnxruntime session is shared by
every stream (`run` is thread-safe) and each stream keeps its own recurrent state and context.
Audio is 16 kHz float32, judged in 32 ms windows (512 samples). The graph takes a batch: `silero_step`
judges one window of each of several streams in one call (voicebot/serving/vad.py batches the
sessions' windows that way), each row reading and writing its own stream's state.

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
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from voicebot.audio.rates import LISTEN_RATE
from voicebot.config import EndpointConfig

SAMPLE_RATE = LISTEN_RATE  # Silero's 16 kHz graph
WINDOW = 512
CONTEXT = 64
WINDOW_MS = WINDOW * 1000 / SAMPLE_RATE  # 32 ms
_RATE = np.array(SAMPLE_RATE, dtype=np.int64)
QUIET_MARGIN_DB = 6.0
# Silero's hangover is one to three windows; a longer quiet stretch it calls speech is someone
# speaking softly, which must not end the utterance early.
HANGOVER_WINDOWS_MAX = 3
# The room's level: an exponential average over non-speech windows, about 10 windows (320 ms).
ROOM_LEVEL_WEIGHT = 0.1


@functools.lru_cache(maxsize=1)
def silero_session():
    import onnxruntime
    import silero_vad

    # The 16 kHz graph without If branches: the same probabilities (to 5e-7) as silero_vad.onnx,
    # about 13 % less time per window (bench/hotpath.py).
    path = Path(silero_vad.__file__).parent / "data" / "silero_vad_op18_ifless.onnx"
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # the graph carries unused initializers; onnxruntime warns about each
    return onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


class SileroVad:
    """One stream's recurrent state and context; the speech probability of its windows."""

    def __init__(self) -> None:
        self.state = np.zeros((2, 1, 128), np.float32)
        self.context = np.zeros((1, CONTEXT), np.float32)

    def probabilities(self, windows: np.ndarray) -> np.ndarray:
        """The windows (k, WINDOW) of this stream in order, one call each (batch 1)."""
        return np.array([silero_step([self], window[None])[0] for window in windows], np.float32)


def silero_step(vads: Sequence[SileroVad], windows: np.ndarray) -> np.ndarray:
    """The next window (B, WINDOW) of each of B streams in one onnxruntime call; each stream's
    state and context move on by that window. The rows do not mix: a row's probability equals
    its stream's call alone (tests/serving/test_vad.py)."""
    x = np.concatenate([np.concatenate([v.context for v in vads]), windows], axis=1)
    state = np.concatenate([v.state for v in vads], axis=1)
    prob, state = silero_session().run(None, {"input": x, "state": state, "sr": _RATE})
    for i, vad in enumerate(vads):
        vad.state = state[:, i : i + 1]
        vad.context = x[i : i + 1, -CONTEXT:]
    return prob[:, 0]


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
        self._room_db: float | None = None  # the level of the recent non-speech windows
        self._quiet_speech = 0  # speech windows no louder than the room at the end of the speech so far
        # Consecutive speech windows right now: the barge-in detector reads it.
        self.speech_run_ms = 0.0

    @property
    def silence_ms(self) -> float:
        """Silence since the last speech window (0 while the user speaks): what a turn policy reads."""
        return (self.samples_seen - self._last_speech_end) * 1000 / SAMPLE_RATE

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

    def decide(self, windows: np.ndarray, probabilities: np.ndarray) -> list[VadEvent]:
        """The endpoint rule over the windows `cut` returned and their speech probabilities
        (a few comparisons per window: cheap enough for the event loop)."""
        events: list[VadEvent] = []
        for window, probability in zip(windows, probabilities):
            events.extend(self._window(window, probability))
        return _merge_audio(events)

    def force_end(self) -> list[VadEvent]:
        """End the utterance now (the client sent input.end)."""
        if not self.in_utterance:
            self._reset_utterance()
            return []
        return [self._end()]

    def _window(self, window: np.ndarray, probability: float) -> list[VadEvent]:
        speech = probability >= self.config.threshold
        level_db = 10 * np.log10(float(np.dot(window, window)) / WINDOW + 1e-18)
        self.samples_seen += WINDOW
        self.speech_run_ms = self.speech_run_ms + WINDOW_MS if speech else 0.0
        if speech:
            quiet = self._room_db is not None and level_db < self._room_db + QUIET_MARGIN_DB
            self._quiet_speech = min(HANGOVER_WINDOWS_MAX, self._quiet_speech + 1) if quiet else 0
            self._speech_windows += 1
            self._silence_windows = 0
            self._last_speech_end = self.samples_seen
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
        )
        self._reset_utterance()
        return event

    def _reset_utterance(self) -> None:
        self.in_utterance = False
        self._pending = []
        self._speech_windows = 0
        self._silence_windows = 0
        self._utterance_windows = 0
        self._quiet_speech = 0


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
