"""End of turn: has the user finished, or only paused?

`SmartTurn` is Smart Turn v3.2 (pipecat's audio end-of-turn classifier, BSD-2), one onnxruntime
session per process shared by every stream. It reads the last 8 s of the turn's 16 kHz audio as
Whisper log-mel features (80 bins x 800 frames, zero-padded at the front) and says how likely the
turn is complete. The model file ships in the pipecat-ai wheel, which is installed with --no-deps
(its dependencies pin soxr and pull numba, openai, aiohttp, Pillow... none of which this needs): it
is found through the distribution's file list, and pipecat itself is never imported.

`TurnPolicy` decides, for one stream, when to ask and what the answer means: ask about a pause of
`smart_pause_ms` of VAD silence (early, at `smart_early_ms`, so the call overlaps the pause);
"complete" at the pause ends the turn; "incomplete" keeps listening and asks again every
`smart_reask_ms` of further silence (not when the last answer's time says this one would come
after the limit), until `smart_limit_ms` ends the turn anyway. "Complete" is the answer at or
above a threshold that falls with the silence asked about, from `smart_threshold` at the pause to
`smart_threshold_floor` at the limit (the longer the pause, the less the model needs to be sure),
after the transcript's last words moved it (voicebot/audio/turn_words.py: `smart_words_hold` /
`smart_words_go`, in log-odds).
"""

from __future__ import annotations

import asyncio
import enum
import importlib.metadata
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from voicebot.audio import turn_words
from voicebot.audio.turn_words import Cue
from voicebot.config.stages import EndpointConfig
from voicebot.serving.worker import Worker

SAMPLE_RATE = 16000
WINDOW_S = 8  # the model was trained on the last 8 s of each turn
WINDOW_SAMPLES = SAMPLE_RATE * WINDOW_S
MODEL_FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"


class SmartTurnUnavailable(RuntimeError):
    """The model file cannot be found or loaded; the message says why and how to fix it."""


def model_path() -> Path:
    try:
        dist = importlib.metadata.distribution("pipecat-ai")
    except importlib.metadata.PackageNotFoundError:
        raise SmartTurnUnavailable(
            "pipecat-ai is not installed (it ships the Smart Turn model): pip install --no-deps pipecat-ai==1.14.0"
        ) from None
    path = Path(str(dist.locate_file(MODEL_FILE)))
    if not path.is_file():
        raise SmartTurnUnavailable(f"pipecat-ai {dist.version} has no {MODEL_FILE} (expected at {path})")
    return path


def last_window(audio: np.ndarray) -> np.ndarray:
    """The last 8 s of `audio`, zero-padded at the front (as the model was trained)."""
    audio = np.asarray(audio, np.float32)[-WINDOW_SAMPLES:]
    return np.pad(audio, (WINDOW_SAMPLES - len(audio), 0))


def with_silence(audio: np.ndarray, silent_samples: int, total_silent_samples: int) -> np.ndarray:
    """`audio`, whose last `silent_samples` are the silence heard so far, with that silence repeated
    until `total_silent_samples` of it: the input an early question asks about for a later pause.

    Repeating the room (not zeros) keeps its level: the model's answer moves with the tail's level
    (bench/smart_turn.py), and a tail of digital silence stays exactly what the pause would hear.
    """
    missing = total_silent_samples - silent_samples
    if missing <= 0 or silent_samples <= 0:
        return audio
    tail = audio[-silent_samples:]
    return np.concatenate([audio, np.tile(tail, -(-missing // len(tail)))[:missing]])


class LogMel:
    """Whisper's log-mel features of a batch of turns' last 8 s, as transformers' WhisperFeatureExtractor
    computes them (its torch path: each window normalised to zero mean and unit variance, a 400-sample
    Hann STFT every 160 samples, power, 80 mel bins, log10 floored 8 below the window's peak, scaled),
    in one pass over the batch: the extractor's own call spends as much again padding, building
    attention masks and converting row by row (bench/per_speaker_cost.py). The same features to 1e-5
    (tests/unit/test_turn.py)."""

    def __init__(self) -> None:
        import torch
        from transformers import WhisperFeatureExtractor

        extractor = WhisperFeatureExtractor(chunk_length=WINDOW_S, feature_size=80, sampling_rate=SAMPLE_RATE)
        self._torch = torch
        self.n_fft, self.hop = extractor.n_fft, extractor.hop_length
        self.mel_filters = torch.from_numpy(np.ascontiguousarray(extractor.mel_filters.T, np.float32))  # (80, 201)
        self.window = torch.hann_window(self.n_fft)

    def __call__(self, turns: list[np.ndarray]) -> np.ndarray:
        """(len(turns), 80, 800) float32 features of each turn's `last_window`."""
        torch = self._torch
        audio = np.stack([last_window(t) for t in turns])
        audio = (audio - audio.mean(axis=1, keepdims=True)) / np.sqrt(audio.var(axis=1, keepdims=True) + 1e-7)
        stft = torch.stft(torch.from_numpy(audio), self.n_fft, self.hop, window=self.window, return_complex=True)
        power = torch.view_as_real(stft[..., :-1]).square().sum(-1)  # |X|^2 without the square root of abs()
        log_spec = torch.clamp(self.mel_filters @ power, min=1e-10).log10()
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        return ((torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0).numpy()


@dataclass(frozen=True)
class Answer:
    probability: float  # that the turn is complete
    queued_s: float  # waiting for the call in progress (another session's question) to finish
    model_s: float  # the call that answered: features and model, for the whole batch it was in


class SmartTurn:
    """Smart Turn v3.2, shared by every session.

    `await ask(audio)` from any session; `calls` worker threads answer whatever is waiting, each in
    calls of at most `max_batch` questions, in the order asked. Waiting questions are bounded by the
    sessions (a `TurnPolicy` has at most one question out). onnxruntime runs without the GIL, so two
    calls at once use two cores: many speakers pausing together (a show's audience answering the
    host) otherwise queue behind one thread, 16 questions at ~33 ms each about half a second for the last.

    Two a call: on one thread a row costs the same CPU in a call of 1 or 2 and about 1.5 times as
    much in a call of 4 or 8 (31, 32, 44, 49 ms, bench/per_speaker_cost.py on this project's 2-core
    machine: the larger batch's activations leave the cache). So a larger call only delays the
    answers it holds: 8 waiting questions answered two at a time are all in by about 250 ms, the
    first by 65; in one call, all at about 390.
    """

    def __init__(self, path: Path | None = None, threads: int = 1, max_batch: int = 2, calls: int = 2) -> None:
        import onnxruntime

        path = path or model_path()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # onnxruntime's CPU arena keeps the largest batch's activations for good: after batches of
        # 1, 2, 4, 8, 2, 1, 8 it held 152 MB, then 232 MB (a late step in a soak's RSS that never came
        # back); without it 43, then 106 MB, at about the same cost: 90-94 ms a row at batch 1, 92 at
        # batch 8 (bench/smart_turn.py --memory).
        options.enable_cpu_mem_arena = False
        try:
            self._session = onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own untyped errors for a bad file
            raise SmartTurnUnavailable(f"cannot load {path}: {exc}") from exc
        self.path = path
        # The same features as pipecat's own (vendored) copy of Whisper's extractor (tests/unit/test_turn.py).
        self.features = LogMel()
        self.worker = Worker("smart-turn", threads=calls)
        self.max_batch = max_batch
        self.calls = calls
        self._waiting: list[tuple[np.ndarray, float, asyncio.Future[Answer]]] = []  # (audio, asked at, answer)
        self._drainers: set[asyncio.Task] = set()  # at most `calls`, each making one call at a time
        self.batches = 0  # calls made, for tests and metrics
        self.questions = 0

    def predict(self, windows: list[np.ndarray]) -> np.ndarray:
        """Probability that each turn is complete (blocking: runs on the worker thread)."""
        (probabilities,) = self._session.run(None, {"input_features": self.features(windows)})
        return probabilities[:, 0]

    async def ask(self, audio: np.ndarray) -> Answer:
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting.append((audio, time.monotonic(), future))
        self._drainers = {d for d in self._drainers if not d.done()}  # done as its loop returns, before any callback
        if len(self._drainers) < self.calls:
            self._drainers.add(asyncio.create_task(self._drain(), name="smart-turn"))
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch = [q for q in self._waiting[: self.max_batch] if not q[2].done()]  # done: its asker gave up
            del self._waiting[: self.max_batch]
            if not batch:
                continue
            self.batches += 1
            self.questions += len(batch)
            started = time.monotonic()
            try:
                probabilities = await self.worker.run(self.predict, [audio for audio, _, _ in batch])
            except Exception as exc:
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            model_s = time.monotonic() - started
            for (_, asked, future), p in zip(batch, probabilities):
                if not future.done():
                    future.set_result(Answer(float(p), started - asked, model_s))

    def close(self) -> None:
        self.worker.shutdown()


class Action(enum.Enum):
    NONE = "none"
    ASK = "ask"  # ask the model (at the pause: and start preparing a reply)
    COMPLETE = "complete"  # the pause is reached and the early question's answer, held until then, says "complete"
    END = "end"  # the turn is over: by silence (the limit, or the silence rule)


@dataclass(frozen=True)
class TurnEnd:
    by: str  # "smart" | "silence" | "input.end"
    probability: float | None  # the model's last answer in this turn, if it was asked
    pause_ms: float  # silence heard when the decision was made


class TurnPolicy:
    """For one stream: when to ask the model, and what its answer means.

    Fed the length of the current silence after each chunk of audio (0 while the user speaks),
    and the turn's transcript when a segment's is in; answers with an `Action`. Synchronous and
    model-free, so the session decides what to run, and bench/turn_offline.py replays this very
    class on recorded answers.

    The first question of a pause is asked early, at `smart_early_ms`, about the pause to come
    (`asked_for_ms`: the silence its input must be padded to, `with_silence`), so that its answer
    is in at about the pause instead of a model call after it. An answer that comes before the
    pause is held until the pause is reached; speech meanwhile discards it.
    """

    def __init__(self, config: EndpointConfig, smart: bool) -> None:
        self.config = config
        self.smart = smart
        self.question = 0  # numbers the questions, so an answer to a stale one is ignored
        # How long the last answer took, in silence heard meanwhile (ms): a question whose answer
        # would come after the silence limit is not asked. Its call would be thrown away (the
        # limit ends the turn first) and, under load, lengthen every other session's batch.
        self.answer_ms = 0.0
        self._asked_at_ms = 0.0
        self.cue = Cue.NONE  # what the transcript so far says (on_text); none until a pause's is in
        self.reset()

    def reset(self) -> None:
        """A new turn (or the user spoke again): the schedule starts over."""
        self.asking = False  # a question is out; no second one until its answer
        self.next_ask_ms = float(self.config.smart_early_ms or self.config.smart_pause_ms)
        self.asked_for_ms = 0.0  # the silence the question out (or last asked) is about
        self.probability: float | None = None  # the model's last answer, as it said it
        self._answered_for_ms = 0.0  # the silence that answer is about
        self.held = False  # an early "complete", waiting for the pause
        self.cue = Cue.NONE

    @property
    def limit_ms(self) -> float:
        return float(self.config.smart_limit_ms if self.smart else self.config.endpoint_silence_ms)

    def threshold(self, silence_ms: float) -> float:
        """The probability of "complete" that ends the turn, for an answer about `silence_ms` of pause:
        `smart_threshold` at the pause, falling linearly to `smart_threshold_floor` at the limit."""
        c = self.config
        grown = min(1.0, max(0.0, (silence_ms - c.smart_pause_ms) / (c.smart_limit_ms - c.smart_pause_ms)))
        return c.smart_threshold + (c.smart_threshold_floor - c.smart_threshold) * grown

    def weighed(self, probability: float) -> float:
        """The model's probability with the words' cue added in log-odds."""
        shift = {Cue.HOLD: -self.config.smart_words_hold, Cue.GO: self.config.smart_words_go}.get(self.cue, 0.0)
        if shift == 0:
            return probability
        p = min(max(probability, 1e-6), 1 - 1e-6)
        return 1 / (1 + math.exp(-(math.log(p / (1 - p)) + shift)))

    def _complete(self) -> bool:
        return self.probability is not None and self.weighed(self.probability) >= self.threshold(self._answered_for_ms)

    def on_silence(self, silence_ms: float) -> Action:
        if silence_ms == 0:
            if self.asking or self.probability is not None or self.cue is not Cue.NONE:
                self.reset()
            return Action.NONE
        if silence_ms >= self.limit_ms:
            return Action.END
        if self.held and silence_ms >= self.config.smart_pause_ms:
            self.held = False
            return Action.COMPLETE
        if self.smart and not self.asking and silence_ms >= self.next_ask_ms and silence_ms + self.answer_ms < self.limit_ms:
            self.asking = True
            self._asked_at_ms = silence_ms
            self.question += 1
            self.asked_for_ms = max(silence_ms, float(self.config.smart_pause_ms))
            return Action.ASK
        return Action.NONE

    def on_answer(self, question: int, probability: float, silence_ms: float) -> bool:
        """The model's answer to `question`, heard at `silence_ms`: True ends the turn.

        An answer to an earlier question (the user spoke again since) is ignored; an early
        "complete" before the pause is held (on_silence answers COMPLETE at the pause).
        """
        if question != self.question or not self.asking:
            return False
        self.asking = False
        self.answer_ms = silence_ms - self._asked_at_ms
        self.probability, self._answered_for_ms = probability, self.asked_for_ms
        # An answer stands for the pause it was asked about: the next question is a re-ask after it.
        self.next_ask_ms = max(self.next_ask_ms, self.asked_for_ms + self.config.smart_reask_ms)
        while self.next_ask_ms <= silence_ms:
            self.next_ask_ms += self.config.smart_reask_ms
        return self._decides(silence_ms)

    def on_text(self, text: str, silence_ms: float) -> bool:
        """The turn's transcript so far (a segment's is in), heard at `silence_ms`: True ends the
        turn, the last answer weighed with what its last words say now (a "complete" said before
        the transcript came may no longer be; an "incomplete" may be)."""
        self.cue = turn_words.cue(text)
        return not self.asking and self._decides(silence_ms)

    def _decides(self, silence_ms: float) -> bool:
        self.held = False
        if not self._complete():
            return False
        if silence_ms < self.config.smart_pause_ms:
            self.held = True
            return False
        return True

    def end(self, by: str, silence_ms: float) -> TurnEnd:
        decision = TurnEnd(by, self.probability, silence_ms)
        self.reset()
        return decision
