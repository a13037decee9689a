"""The bot hearing itself: its reply fed back into its input, echo cancellation off and on side by side.

    python bench/echo.py [--config configs/default.yaml] [--delays 50 150 300] [--gains -6 -20]
    python bench/echo.py --cpu   # only the cancellers' CPU time per second of audio
    python bench/echo.py --offline   # only the barge-ins offline (no server), more replies and times

One server (a subprocess on 127.0.0.1); one session per case, so each canceller starts cold, as a
new stream's does. The client is a speaker and a microphone in one: it streams its input in real
time (40 ms chunks), asks for a spoken reply (`say`), plays each reply frame as it arrives (after
the one before it; an `audio.interrupted` drops what is not played yet, as the mic page does), and
mixes what it played back into its input `delay` ms later at `gain` dB: the room, or OBS's desktop
mix. In the barge-in cases a real user (espeak-ng) talks over the reply from BARGE_AT_S into it.

Per case:
- attenuation: energy in over energy out of the canceller while the bot spoke
  (voicebot_echo_attenuation_db, observed when the session closes; none without a canceller); the
  echo's attenuation in the cases without a barge-in (with one, the user's speech, kept, is in it);
- false barge-ins: replies interrupted (`barge_in`) before any user spoke;
- echo utterances: speech the endpointer heard in the echo (begun before the user spoke), and the
  recognizer's transcripts of them;
- barge-in delay: from the first sample of the real barge-in to the `audio.interrupted` that
  stopped the reply (`pacing.barge_in_min_ms` of speech has to be heard first);
- heard: what the recognizer made of the barge-in itself.
- words kept: the case's own input (the room's output, sample for sample) run again through a
  canceller here, the far end given as it played, and both of its outputs compared with what the
  user said over each 200 ms of the first second of the barge-in: the speech's gain in the output
  (its projection, the worst frame and the mean) for AEC3's suppressed output (the gate, the VAD and
  barge-in hear it) and the linear one (the recognizer hears it), and the echo that came in under
  the words over the rest of the linear output there (what is not the speech: echo left, and the
  canceller's own distortion of the speech, which dominates it when the echo is quiet); the echo
  alone run through another canceller, and what its linear output leaves of the echo there (echo
  down: how far MDF had converged when the user spoke); and what the default config's recognizer
  (pocketsphinx on the bench's phrases) makes of the linear output over the whole barge-in, as one
  utterance: the same input every run, where the live `heard` also depends on the box's load and
  where the endpointer cut. And where the front end starts the barge-in's utterance on the
  suppressed output (the recognizer hears the linear output from there): the endpoint rule's own
  start, and EchoOnset's (voicebot/audio/echo_onset.py), with what the recognizer made of each. --offline also applies the barge-in rule (Silero, 300 ms of speech in a
  row) to the suppressed output: of the echo alone (a false barge-in), and of the input with the
  user (how long after the first word it is met), and how many utterances the endpoint rule cuts the
  barge-in into on it (two: the suppressor took endpoint_silence_ms from inside the words; the reply
  plays on offline, where live the barge-in would cut it), through the front end's endpoint rule
  (EchoOnset.hid: the windows the suppressor hid are not the user's silence), and how much later than
  its silence alone each of those utterances ended for it (VadEvent.held_ms: the echo plays on after
  the words offline, so it is the bound, HELD_SILENCE_SHARE of endpoint_silence_ms, wherever they end).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.latency import start_server  # noqa: E402
from tests.audio import espeak_speech, to_pcm16  # noqa: E402
from voicebot.audio.echo import EchoCanceller  # noqa: E402
from voicebot.audio.linear_echo import BLOCK, LinearCanceller  # noqa: E402
from voicebot.audio.endpoint import WINDOW, Endpointer, EventKind  # noqa: E402
from voicebot.audio.resample import StreamResampler  # noqa: E402
from voicebot.config import EndpointConfig  # noqa: E402
from voicebot.audio.echo_onset import EchoOnset  # noqa: E402

RATE = 16000
CHUNK = RATE * 40 // 1000  # the mic page's 40 ms
REPLY = ("Here is a longer reply from the bot. It keeps talking for a few seconds, as replies do, "
         "so that the echo has time to come back.")
BARGE_IN = "Stop talking now please, I want to say something."
BARGE_AT_S = 2.0  # into the reply's playback
# --offline: more replies, and barge-ins earlier (0.5 s: before any echo is confirmed) and later into them
OFFLINE_REPLIES = [
    REPLY,
    "Welcome back to the stream, everyone. Tonight we are playing the new map, and the chat has a lot of questions about it.",
    "Sure, I can explain that. The first step is to open the settings menu, then pick the audio tab and choose your microphone.",
]
OFFLINE_BARGE_AT_S = (0.5, 1.5, 2.0, 2.5)


def clauses(*texts: str) -> list[str]:
    return [c.strip() for c in re.split(r"[,.]", " ".join(texts)) if c.strip()]


# The recognizer's grammar, live: one phrase an utterance, and the barge-in is one utterance or two
# (as the endpointer cuts it at its comma), so it is there whole as well as in halves.
PHRASES = clauses(REPLY, BARGE_IN) + [BARGE_IN]
SAY_AT_S = 0.5  # after the session is ready
TAIL_S = 1.5  # kept listening after the reply (or the barge-in) ended
CASE_LIMIT_S = 20.0
BUFFER_S = CASE_LIMIT_S + 5  # the case's timeline: what was played, what the user said
FRAME = RATE // 5  # words kept are judged per 200 ms


@dataclass
class CaseResult:
    aec: bool
    delay_ms: int
    gain_db: int | None  # None: no echo at all (the barge-in's own delay, for reference)
    barge: bool
    attenuation_db: float | None = None
    false_barge_ins: int = 0
    echo_utterances: int = 0
    echo_transcripts: list[str] = field(default_factory=list)
    barge_in_delay_ms: float | None = None
    heard: str = ""
    # The barge-in's first second in each output, offline: the speech's gain, (worst 200 ms, mean) dB.
    kept_suppressed_db: tuple[float, float] | None = None
    kept_linear_db: tuple[float, float] | None = None
    linear_echo_over_rest_db: float | None = None  # the echo in under those words over what is not them in the linear output
    linear_echo_down_db: float | None = None  # the echo in under those words over what the linear output leaves of it
    heard_offline: str = ""  # what the recognizer made of the linear output there, offline, as one utterance
    # Offline, the barge-in rule (Silero, pacing.barge_in_min_ms in a row) on the suppressed output:
    # whether the echo alone met it, and how long after the user began the input with the user did.
    echo_barged_in_offline: bool = False
    barge_in_offline_ms: float | None = None
    # Offline, the barge-in's utterance on the suppressed output, from the user's first word (negative:
    # before it), and what the recognizer made of the linear output from there: (the endpoint rule's own, EchoOnset's).
    utterance_start_ms: tuple[float, float] | None = None
    heard_from_start: tuple[str, str] = ("", "")
    # Offline, how many utterances the endpoint rule began over the barge-in (more than one: the
    # suppressor took endpoint_silence_ms from inside the words, and they were cut in two).
    utterances: int = 0
    # ... and how much later each ended than its silence alone would have ended it (ms; VadEvent.held_ms)
    held_ms: list[float] = field(default_factory=list)


class Room:
    """The client's loudspeaker and microphone on one sample clock (sample k is at t0 + k / RATE)."""

    def __init__(self, delay_ms: int, gain_db: int | None) -> None:
        self.played = np.zeros(int(BUFFER_S * RATE), np.float32)  # what the speaker plays, when
        self.voice = np.zeros_like(self.played)  # what the user says, when
        self.delay = delay_ms * RATE // 1000
        self.gain = 0.0 if gain_db is None else 10 ** (gain_db / 20)
        self.play_end = 0  # the speaker is busy until this sample
        self.t0 = time.monotonic()
        self._resampler = StreamResampler(24000, RATE)

    def now(self) -> int:
        return int((time.monotonic() - self.t0) * RATE)

    def play(self, frame_pcm: bytes) -> int:
        """A reply frame arrived: it plays after what is queued; returns where it starts."""
        audio = self._resampler.process(np.frombuffer(frame_pcm, "<i2").astype(np.float32) / 32768.0)
        start = max(self.now(), self.play_end)
        end = min(start + len(audio), len(self.played))
        self.played[start:end] = audio[: end - start]
        self.play_end = end
        return start

    def drop_unplayed(self) -> None:
        now = self.now()
        self.played[now:] = 0
        self.play_end = now
        self._resampler = StreamResampler(24000, RATE)

    def say(self, speech: np.ndarray, at: int) -> None:
        end = min(at + len(speech), len(self.voice))
        self.voice[at:end] += speech[: end - at]

    def mic(self, k: int, with_voice: bool = True) -> np.ndarray:
        """Input samples k .. k + CHUNK: the user (unless not `with_voice`) plus the echo of what played `delay` ago."""
        echo = np.zeros(CHUNK, np.float32)
        lo = k - self.delay
        if lo + CHUNK > 0:
            src = self.played[max(0, lo) : lo + CHUNK]
            echo[CHUNK - len(src):] = src
        return (self.voice[k : k + CHUNK] if with_voice else 0) + self.gain * echo


async def run_case(url: str, case: CaseResult, barge_speech: np.ndarray) -> CaseResult:
    import websockets

    room = Room(case.delay_ms, case.gain_db)
    log: list[tuple[int, dict]] = []  # (sample clock, event)
    barge_at: int | None = None  # where the user starts talking, once the reply has started
    reply_over: int | None = None

    async with websockets.connect(url, max_size=None, ping_interval=None) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": RATE, "echo_cancellation": case.aec}))

        async def receive() -> None:
            nonlocal barge_at, reply_over
            async for message in ws:
                if isinstance(message, bytes):
                    start = room.play(message)
                    if case.barge and barge_at is None:
                        barge_at = start + int(BARGE_AT_S * RATE)
                        room.say(barge_speech, barge_at)
                    continue
                event = json.loads(message)
                log.append((room.now(), event))
                if event["type"] == "audio.interrupted":
                    room.drop_unplayed()
                if event["type"] in ("audio.end", "audio.interrupted") and reply_over is None:
                    reply_over = max(room.play_end, room.now())

        reader = asyncio.create_task(receive())
        k = 0
        said = False
        while k < CASE_LIMIT_S * RATE:
            await asyncio.sleep(max(0.0, room.t0 + (k + CHUNK) / RATE - time.monotonic()))
            await ws.send(to_pcm16(room.mic(k)))
            k += CHUNK
            if not said and k >= SAY_AT_S * RATE:
                await ws.send(json.dumps({"type": "say", "text": REPLY}))
                said = True
            user_done = barge_at + len(barge_speech) if barge_at is not None else 0
            if reply_over is not None and k > max(reply_over, user_done) + TAIL_S * RATE:
                break
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader

    user_from = barge_at if barge_at is not None else len(room.voice)  # before it, only the bot spoke
    if case.aec and case.barge and case.gain_db is not None and user_from + RATE <= k:
        words_kept(case, room, k, user_from, len(barge_speech))
    started = {e["utterance_id"]: at for at, e in log if e["type"] == "speech.started"}
    case.echo_utterances = sum(1 for at in started.values() if at < user_from)
    for at, e in log:
        if e["type"] == "audio.interrupted" and e["reason"] == "barge_in":
            if at < user_from:
                case.false_barge_ins += 1
            elif case.barge_in_delay_ms is None:
                case.barge_in_delay_ms = (at - user_from) * 1000 / RATE
        if e["type"] == "asr.final" and e["text"].strip():
            if started.get(e["utterance_id"], at) < user_from:
                case.echo_transcripts.append(e["text"])
            else:
                case.heard += (" " if case.heard else "") + e["text"]
    return case


def cancelled(room: Room, end: int, with_voice: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[bool]]:
    """The case's input (or its echo alone) through a canceller here, the far end given as the
    speaker played it, on the room's clock: (input, suppressed output, linear output, whether the
    canceller suppressed after each CHUNK)."""
    canceller = EchoCanceller(reply_rate=RATE)
    mic, suppressed, linear, suppressing = [], [], [], []
    for k in range(0, end, CHUNK):
        canceller.play(room.played[k : k + CHUNK], sent_at=k / RATE)
        mic.append(room.mic(k, with_voice))
        out = canceller.process(mic[-1], arrived=(k + CHUNK) / RATE)
        suppressed.append(out.suppressed)
        linear.append(out.linear)
        suppressing.append(canceller.suppressing)
    return np.concatenate(mic), np.concatenate(suppressed), np.concatenate(linear), suppressing


def endpoint_events(suppressed: np.ndarray, linear: np.ndarray, suppressing: list[bool], chunk: int):
    """The front end's endpoint rule (the default EndpointConfig, Silero, EchoOnset) over the canceller's
    outputs, given whether it suppressed after each `chunk` of input, as the front end reads it: each
    event, where the stream stands after its window, and the EchoOnset (voicebot/session/listening.py)."""
    endpointer, onset = Endpointer(EndpointConfig()), EchoOnset()
    windows = endpointer.cut(suppressed)
    for k, probability in enumerate(endpointer.vad.probabilities(windows)):
        onset.observe(windows[k], suppressing[((k + 1) * WINDOW - 1) // chunk])
        hidden = onset.hid(linear[k * WINDOW : (k + 1) * WINDOW])
        for event in endpointer.decide(windows[k : k + 1], np.array([probability]), [hidden]):
            yield event, endpointer.samples_seen, onset


def utterance_starts(suppressed: np.ndarray, linear: np.ndarray, suppressing: list[bool], chunk: int,
                     after: int = 0) -> tuple[int, int] | None:
    """Where the front end starts the first utterance that it begins after sample `after` (its START
    event), pre-speech included: the endpoint rule's own start, and EchoOnset's. None: no utterance."""
    for event, at, onset in endpoint_events(suppressed, linear, suppressing, chunk):
        if event.kind is EventKind.START and at > after:
            start = at - len(event.audio)
            return start, onset.start(start, at, 0)
    return None


def utterances_begun(suppressed: np.ndarray, linear: np.ndarray, suppressing: list[bool], chunk: int,
                     start: int, end: int) -> tuple[int, list[float]]:
    """How many utterances the front end's endpoint rule begins between samples `start` and `end` (its
    START events), and of those that end within `suppressed`, how much later than its silence alone would
    have ended it (the windows the suppressor hid after its last speech: VadEvent.held_ms)."""
    begun, held = 0, []
    for event, at, _ in endpoint_events(suppressed, linear, suppressing, chunk):
        if event.kind is EventKind.START and start <= at <= end:
            begun += 1
        elif event.kind is EventKind.END and begun > len(held):
            held.append(event.held_ms)
    return begun, held


@functools.cache
def offline_decoder(figure: str):
    """The default config's recognizer, on the phrases of every reply here and the whole barge-in as one
    (one utterance here); one per `figure`, so that each figure's decoder hears the same utterances
    in the same order whatever else is measured (its cepstral mean carries from one to the next)."""
    from voicebot.asr.pocketsphinx_decoders import Decoders

    # One decoder built here, as a session's process builds it (the recognizer lends its decoders
    # only to streams, in child processes).
    return Decoders(clauses(*OFFLINE_REPLIES, BARGE_IN) + [BARGE_IN], False, 1, lambda build: build()).new_decoder()


def heard_offline(audio: np.ndarray, figure: str = "words heard") -> str:
    decoder = offline_decoder(figure)
    decoder.start_utt()
    decoder.process_raw(to_pcm16(audio), False, True)
    decoder.end_utt()
    return decoder.hyp().hypstr if decoder.hyp() else ""


def barged_in_at(audio: np.ndarray, min_ms: int = 300) -> int | None:
    """The sample where Silero has heard `min_ms` (configs/default.yaml's pacing.barge_in_min_ms) of speech in a row."""
    from voicebot.audio.endpoint import WINDOW, WINDOW_MS, SileroVad

    run = 0
    for k, probability in enumerate(SileroVad().probabilities(audio[: len(audio) // WINDOW * WINDOW].reshape(-1, WINDOW))):
        run = run + WINDOW_MS if probability >= 0.5 else 0
        if run >= min_ms:
            return (k + 1) * WINDOW
    return None


def words_kept(case: CaseResult, room: Room, end: int, user_from: int, user_len: int) -> None:
    """The case's input through a canceller here, each output against what the user said."""
    mic, suppressed, linear, suppressing = cancelled(room, end)
    voice = room.voice[user_from : user_from + RATE]
    echo = mic[user_from : user_from + RATE] - voice

    def kept(out: np.ndarray) -> tuple[float, float, np.ndarray]:
        lag = max(range(0, 480, 16), key=lambda d: float(np.dot(out[user_from + d : user_from + d + RATE], voice)))
        out = out[user_from + lag : user_from + lag + RATE]
        gains = [float(np.dot(out[i : i + FRAME], voice[i : i + FRAME]) / np.dot(voice[i : i + FRAME], voice[i : i + FRAME]))
                 for i in range(0, RATE, FRAME)]
        db = [20 * np.log10(max(g, 1e-6)) for g in gains]
        return min(db), float(np.mean(db)), out - np.repeat(gains, FRAME) * voice

    worst, mean, _ = kept(suppressed)
    case.kept_suppressed_db = (worst, mean)
    at = barged_in_at(suppressed[user_from:])
    case.barge_in_offline_ms = None if at is None else at / RATE * 1000
    worst, mean, left = kept(linear)
    case.kept_linear_db = (worst, mean)
    if np.any(echo):  # else the reply was over (or cut) before the user spoke
        case.linear_echo_over_rest_db = float(10 * np.log10(np.dot(echo, echo) / max(float(np.dot(left, left)), 1e-12)))
        # The echo alone through a canceller: what the linear output leaves of it there, the
        # speech's distortion no part of it (the filter adapts on the echo alone, as before the user spoke).
        _, echo_suppressed, echo_left, _ = cancelled(room, end, with_voice=False)
        case.echo_barged_in_offline = barged_in_at(echo_suppressed) is not None
        echo_left = echo_left[user_from : user_from + RATE]
        case.linear_echo_down_db = float(10 * np.log10(np.dot(echo, echo) / max(float(np.dot(echo_left, echo_left)), 1e-12)))
    words_end = user_from + user_len + RATE * 3 // 10
    case.heard_offline = heard_offline(linear[user_from - RATE // 10 : words_end])
    case.utterances, case.held_ms = utterances_begun(suppressed, linear, suppressing, CHUNK, user_from, words_end)
    if (starts := utterance_starts(suppressed, linear, suppressing, CHUNK, after=user_from)) is not None:
        case.utterance_start_ms = tuple((start - user_from) * 1000 / RATE for start in starts)
        case.heard_from_start = tuple(heard_offline(linear[start:words_end], figure)
                                      for start, figure in zip(starts, ("endpoint rule", "EchoOnset")))


def offline(delays: list[int], gains: list[int]) -> None:
    """No server: each reply of OFFLINE_REPLIES played into each room, the barge-in from each of
    OFFLINE_BARGE_AT_S into it, through words_kept: the same input every run, for comparing cancellers."""
    speech = espeak_speech(BARGE_IN, "en-gb") * 0.7
    said = BARGE_IN.lower().replace(",", "").replace(".", "").split()
    start = int(SAY_AT_S * RATE)
    print(f"offline: {len(OFFLINE_REPLIES)} replies x barge-in at {OFFLINE_BARGE_AT_S} s; of the barge-in's "
          f"{len(said)} words, those the recognizer heard in the linear output; the echo under them, down (mean); "
          f"the echo alone barging in (the suppressed output, Silero, 300 ms); the barge-in heard after (p50, max; missed); "
          f"where its utterance starts after the first word (ms, p50 and max; the endpoint rule's own -> EchoOnset's) and the "
          f"words the recognizer heard from there (the linear output); the barge-ins cut in two utterances or more by the "
          f"endpoint rule (the reply playing on: no barge-in cuts it offline); how much later than their silence alone the "
          f"barge-in's utterances ended, the suppressor's windows held (p50, max; VadEvent.held_ms), and how many had not "
          f"ended 1 s after the words")
    print(f"{'delay':>6} {'gain':>6} {'words heard':>14} {'echo down':>10} {'echo barged in':>15} {'barge-in ms':>14}"
          f" {'utterance starts ms':>24} {'words heard from it':>22}")
    total = cases = 0
    heard_from_total = [0, 0]
    for delay_ms, gain_db in itertools.product(delays, gains):
        heard, down, echo_barged, barge_ms = 0, [], 0, []
        starts, heard_from, split, held, still_open = [], [0, 0], 0, [], 0
        for text, at_s in itertools.product(OFFLINE_REPLIES, OFFLINE_BARGE_AT_S):
            reply = espeak_speech(text, "en-us", RATE)
            room = Room(delay_ms, gain_db)
            room.played[start : start + len(reply)] = reply[: len(room.played) - start]
            at = start + int(at_s * RATE)
            room.say(speech, at)
            case = CaseResult(True, delay_ms, gain_db, True)
            words_kept(case, room, (at + len(speech) + RATE) // CHUNK * CHUNK, at, len(speech))
            heard += sum(word in case.heard_offline.split() for word in said)
            down.append(case.linear_echo_down_db)
            echo_barged += case.echo_barged_in_offline
            barge_ms.append(case.barge_in_offline_ms)
            split += case.utterances > 1
            held += case.held_ms
            still_open += case.utterances - len(case.held_ms)
            if case.utterance_start_ms is not None:
                starts.append(case.utterance_start_ms)
            for i, text in enumerate(case.heard_from_start):
                heard_from[i] += sum(word in text.split() for word in said)
        n = len(OFFLINE_REPLIES) * len(OFFLINE_BARGE_AT_S) * len(said)
        total, cases = total + heard, cases + n
        found = [ms for ms in barge_ms if ms is not None]
        timing = f"{np.median(found):.0f}, {max(found):.0f}" if found else "-"
        rule, reach = (f"{np.median(s):+.0f}, {max(s):+.0f}" for s in zip(*starts)) if starts else ("-", "-")
        heard_from_total = [t + h for t, h in zip(heard_from_total, heard_from)]
        print(f"{delay_ms:>3} ms {gain_db:>3} dB {heard:>6} of {n:<4} {np.mean(down):>7.1f} dB {echo_barged:>8} of {len(barge_ms)} "
              f"{timing:>11}; {len(barge_ms) - len(found)} {rule:>11} -> {reach:<11} {heard_from[0]:>4} -> {heard_from[1]:>3} of {n}; "
              f"{len(barge_ms) - len(starts)} no utterance, {split} split; ended late "
              f"{f'{np.median(held):.0f}, {max(held):.0f}' if held else '-'} ms, {still_open} open")
    print(f"{'all':>13} {total:>6} of {cases:<4} ({total / cases:.0%}); from the utterance's start: "
          f"{heard_from_total[0]} -> {heard_from_total[1]} of {cases}")


def cpu_cost(seconds: float = 10.0, rounds: int = 5) -> None:
    """CPU time per second of audio: the whole canceller (AEC3, the tracker, the linear canceller)
    and the linear canceller alone on the same blocks, in turns, one thread."""
    reply = espeak_speech(REPLY, "en-us", RATE)
    n = int(seconds * RATE) // CHUNK * CHUNK
    far = np.resize(reply, n)
    near = np.roll(far, RATE * 150 // 1000) * 0.5 + np.resize(espeak_speech(BARGE_IN, "en-gb"), n) * 0.3
    whole, linear_alone = [], []
    for _ in range(rounds):
        canceller = EchoCanceller(reply_rate=RATE)
        started = time.process_time()
        for k in range(0, n, CHUNK):
            canceller.play(far[k : k + CHUNK], sent_at=k / RATE)
            canceller.process(near[k : k + CHUNK], arrived=(k + CHUNK) / RATE)
        whole.append((time.process_time() - started) / seconds * 1000)
        linear = LinearCanceller()
        near_pcm, far_pcm = (near * 32767).astype("<i2"), (far * 32767).astype("<i2")
        started = time.process_time()
        for k in range(0, n, BLOCK):
            linear.process(near_pcm[k : k + BLOCK], far_pcm[k : k + BLOCK])
        linear_alone.append((time.process_time() - started) / seconds * 1000)
    w, lin = np.percentile(whole, [50, 90]), np.percentile(linear_alone, [50, 90])
    print(f"CPU per second of audio ({rounds} rounds of {seconds:.0f} s, p50 / p90): whole canceller {w[0]:.1f} / {w[1]:.1f} ms, "
          f"of which the linear canceller {lin[0]:.1f} / {lin[1]:.1f} ms ({lin[0] / w[0]:.0%} at p50)")


def echo_attenuation(base: str) -> tuple[float, int]:
    """(sum, count) of voicebot_echo_attenuation_db so far."""
    text = httpx.get(base + "/metrics", timeout=5).text
    values = dict(re.findall(r"^voicebot_echo_attenuation_db_(sum|count) (\S+)$", text, re.M))
    return float(values.get("sum", 0)), int(float(values.get("count", 0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--delays", type=int, nargs="+", default=[50, 150, 300])
    parser.add_argument("--gains", type=int, nargs="+", default=[-6, -20])
    parser.add_argument("--cancel", choices=["off", "on"], nargs="+", default=["off", "on"],
                        help="cancellation off, on, or both (the default, side by side)")
    parser.add_argument("--cpu", action="store_true", help="only the cancellers' CPU time per second of audio")
    parser.add_argument("--offline", action="store_true", help="only the barge-ins offline (no server): what the recognizer hears")
    args = parser.parse_args()
    if args.offline:
        offline(args.delays, args.gains)
        return
    cpu_cost()
    if args.cpu:
        return

    barge_speech = espeak_speech(BARGE_IN, "en-gb") * 0.7  # another voice than the bot's
    config = yaml.safe_load(Path(args.config).read_text())
    if config.get("asr", {}).get("engine", "pocketsphinx") == "pocketsphinx":
        # Both texts as phrases: the general English model decodes slower than real time on a
        # loaded 2-core box, and an echo that is transcribed at all still shows.
        config.setdefault("asr", {}).setdefault("pocketsphinx", {})["phrases"] = PHRASES
    server, base, config_file = start_server(config)
    url = base.replace("http", "ws") + "/v1/voice"
    results = []
    try:
        cancel = [mode == "on" for mode in args.cancel]
        cases = [(aec, 0, None, True) for aec in cancel]
        cases += itertools.product(cancel, args.delays, args.gains, (False, True))
        for aec, delay_ms, gain_db, barge in cases:
            before = echo_attenuation(base)
            case = asyncio.run(run_case(url, CaseResult(aec, delay_ms, gain_db, barge), barge_speech))
            for _ in range(50):  # the session's close observes its canceller's figure
                after = echo_attenuation(base)
                if not aec or after[1] > before[1]:
                    break
                time.sleep(0.1)
            if after[1] > before[1]:
                case.attenuation_db = (after[0] - before[0]) / (after[1] - before[1])
            results.append(case)
            print(f"  done: aec {aec} {delay_ms} ms {gain_db} dB barge-in {barge}", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(30)
        Path(config_file).unlink()

    print(f"config {args.config}; reply {len(REPLY)} characters said once per case; barge-in {BARGE_AT_S} s into "
          f"the reply; echo = the client's own playback, delayed and attenuated")
    print(f"{'cancel':>6} {'delay':>6} {'gain':>6} {'barge-in':>8} {'attenuation':>14} {'false barge-ins':>15} "
          f"{'barge-in delay':>14} {'echo utterances':>15}  echo transcripts / what the barge-in was heard as")
    words = []
    for r in results:
        att = "-" if r.attenuation_db is None else f"{r.attenuation_db:.1f} dB" + (" (+user)" if r.barge else "")
        delay = "n/a" if not r.barge else "-" if r.barge_in_delay_ms is None else f"{r.barge_in_delay_ms:.0f} ms"
        gain = "none" if r.gain_db is None else f"{r.gain_db} dB"
        heard = f"{r.echo_transcripts[:2]}" + (f" / {r.heard!r}" if r.barge else "")
        print(f"{'on' if r.aec else 'off':>6} {r.delay_ms:>3} ms {gain:>6} {'yes' if r.barge else 'no':>8} {att:>14} "
              f"{r.false_barge_ins:>15} {delay:>14} {r.echo_utterances:>15}  {heard}")
        if r.kept_linear_db is not None:
            rest = "-" if r.linear_echo_over_rest_db is None else f"{r.linear_echo_over_rest_db:.1f} dB"
            down = "-" if r.linear_echo_down_db is None else f"{r.linear_echo_down_db:.1f} dB"
            words.append(f"{r.delay_ms:>3} ms {gain:>6}  {r.kept_suppressed_db[0]:+9.1f} {r.kept_suppressed_db[1]:+8.1f}"
                         f"  {r.kept_linear_db[0]:+9.1f} {r.kept_linear_db[1]:+8.1f}  {rest:>13} {down:>10}  {r.heard_offline!r}")
    if words:
        print("\nwords kept, the barge-in's first second (offline, the same input, the far end as it played): the "
              "speech's gain in each output per 200 ms, worst and mean; the echo in under it over the rest of the linear output, "
              "and over what the linear output leaves of the echo alone; what the recognizer made of the linear output, one utterance")
        print(f"{'delay':>6} {'gain':>6}  {'suppressed':>18}  {'linear':>18}  {'echo / rest':>13} {'echo down':>10}  heard offline")
        print(f"{'':>14}{'worst':>9} {'mean':>8}  {'worst':>9} {'mean':>8}")
        print("\n".join(words))


if __name__ == "__main__":
    main()
