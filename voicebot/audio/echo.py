"""The bot deaf to its own voice: acoustic echo cancellation of one session's input.

When the reply plays through speakers, or OBS mixes desktop audio into what /obs/audio sends, the
input carries the bot's own voice back, late (playback + capture + network) and attenuated. The
server knows exactly what it sent: each reply frame is the far end, and `EchoCanceller` removes it
from the near end (the 16 kHz input) before the gate, the VAD or the recognizer hear it. Its pieces:

- here: WebRTC's AEC3 (the `aec-audio-processing` package), the far end's queue and its holds. AEC3
  beat speexdsp's canceller by 20-50 dB on the same echo here (24-62 dB vs 2-8 dB at 50-300 ms
  delay), and needs no system library.
- voicebot/audio/linear_echo.py: speexdsp's linear canceller (MDF alone), the recognizer's.
- voicebot/audio/echo_delay.py: `DelayTracker`, the echo's delay (GCC-PHAT) and whether there is
  an echo at all (the no-echo decision: the gate and the VAD then hear the input itself).
- voicebot/audio/echo_onset.py: where an utterance begins when the words start under the echo.

Timing: the far end is consumed at the input's pace, one 10 ms block per 10 ms of input, from the
moment the server sends it (the client plays each frame after the one before it); the echo then
arrives later by the client's playback latency plus the acoustic and capture path. A reply's
first frame is matched with the input that arrived when it was sent, not with the input the
input clock happens to be processing then: under load that input is older (it waited in the
session's queue), and the echo would seem later by that wait, past AEC3's range. For a path beyond
AEC3's reach only (`AEC3_REACH_S`, echo_delay.py), the far end is held back by the tracker's
estimate less `HOLD_MARGIN_S`. A path AEC3 reaches is left alone: every shift of its reference
makes it converge again, and the echo leaks meanwhile.

Double talk: AEC3's first seconds of reply audio are its "initial state", where it suppresses
hardest when the user talks over the bot; it is shortened to 0.6 s (`AEC3_FIELD_TRIALS`, WebRTC's
own configuration override, process-wide), so a barge-in over a new reply's echo is heard about
as soon as one with no echo (bench/echo.py).

Two outputs, one for each listener (`Cancelled`), both at the input's sample positions. The gate,
the VAD and so barge-in need what AEC3's suppressor leaves: the echo all but gone (a linear
canceller leaves residual echo, which must not barge in). The recognizer needs the words: it gets
the linear canceller's output (linear_echo.py), whose far end is held back by the path less
`LINEAR_MARGIN_S`.

The utterance's start (issue 29): the endpoint rule decides on the suppressed output, and where
AEC3 takes the first 0.3-1.2 s of the words off (double talk over a first reply, its linear filter
not yet converged: 10-60 dB per 100 ms), it started the utterance, so the recognizer's audio, inside
the words, and the grammar recognizer made '' of the rest (tests/integration/test_turn_taking.py,
about 1 run in 5). What the suppressor leaves of them still stands above its floor: the front end
reaches back over it while the canceller is `suppressing` (voicebot/audio/echo_onset.py, EchoOnset).
Under an echo as loud as the words, in a new reply's first seconds, the suppressor takes whole
syllables of them to its floor. Where it takes ~0.5 s from inside the words, the endpoint rule heard
endpoint_silence_ms of silence and cut them in two utterances (the live
test_speech_over_the_bots_echo_is_transcribed's three finals: 3 of 35 runs beside one or two busy
processes): a window AEC3's output lies SUPPRESSOR_HID_DB under the linear output's while it
suppresses is not counted as the user's silence inside an utterance, up to half of
endpoint_silence_ms a pause (EchoOnset.hid; the Endpointer's HELD_SILENCE_SHARE, and what it costs). Still open (tests/unit/test_echo.py, strict xfails): where the syllables
it takes are the words' first ~0.3 s, nothing of them rises for EchoOnset.
It is where the reply's syllables fall under the words, not the path: AEC3's reference aligned by
hand from the first block lost as much, and none of its field trials (dominant near-end detection,
suppressor tunings, reverb defaults, no initial state) kept the words without costing elsewhere.

Bounds: unplayed far end at most `MAX_FAR_S` (more is dropped oldest first and counted); each hold
at most `MAX_DELAY_S` (echo_delay.py) of far blocks; the input waits at most one 10 ms block.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from typing import NamedTuple

import numpy as np

from voicebot.audio.echo_delay import AEC3_REACH_S, MAX_DELAY_S, DelayTracker
from voicebot.audio.linear_echo import BLOCK, LinearCanceller, linear_canceller_problem
from voicebot.audio.rates import LISTEN_RATE
from voicebot.audio.resample import StreamResampler

MAX_FAR_S = 2.0  # pacing keeps reply audio at most lead_ms (400 ms by default) ahead of playback
HOLD_MARGIN_S = 0.25  # the far end is held back by the estimate less this: AEC3 then finds the rest itself
MIN_HOLD_CHANGE_S = 0.06  # AEC3 re-converges after every shift: only follow real changes
# A frame sent this long after the audio before it should have finished playing starts a new
# playout (the client ran dry). Not less: the resampler holds back ~21 ms of each frame until the next.
PLAYOUT_GAP_S = 0.05
# AEC3's "initial state" (2.5 s of reply audio, restarted when it detects an echo path change)
# suppresses far more during double talk: a user talking over the first seconds of a reply lost
# the start of the words, and barge-in came 0.5-1.7 s later than with no echo (bench/echo.py).
# 0.6 s of it: no later than a frame. None at all let a "300 ms" echo barge in live last time,
# perhaps the hold shift that AEC3_REACH_S now avoids (that path measures 304-348 ms); not tried again.
AEC3_FIELD_TRIALS = b"WebRTC-Aec3UseDot6SecondsInitialStateDuration/Enabled/"
# The linear canceller's hold: the direct path this far into MDF's filter (LINEAR_FILTER_S, linear_echo.py).
LINEAR_MARGIN_S = 0.04  # the estimate is within a few ms, the hold a whole block, and it moves by LINEAR_HOLD_CHANGE_S
LINEAR_HOLD_CHANGE_S = 0.03  # MDF reset and converging again costs less than a path 60 ms off in a short filter

_field_trials_lock = threading.Lock()
_field_trials: ctypes.Array | None = None  # WebRTC keeps the pointer, not a copy: it lives as long as the process


def _configure_aec3() -> None:
    """Set AEC3_FIELD_TRIALS, process-wide, before the first AEC3 is made."""
    global _field_trials
    from aec_audio_processing import lib

    with _field_trials_lock:
        if _field_trials is not None:
            return
        try:
            init = lib._ZN6webrtc11field_trial25InitFieldTrialsFromStringEPKc  # webrtc::field_trial::InitFieldTrialsFromString
        except AttributeError as exc:
            raise RuntimeError("this aec-audio-processing's WebRTC library cannot be configured (no "
                               "InitFieldTrialsFromString): talking over a reply would be suppressed") from exc
        _field_trials = ctypes.create_string_buffer(AEC3_FIELD_TRIALS)
        init(_field_trials)


def _pcm16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")


class Cancelled(NamedTuple):
    """One stretch of input, echo-cancelled twice, at the same sample positions."""

    suppressed: np.ndarray  # AEC3's: the echo all but gone, and the start of speech over it cut (gate, VAD)
    linear: np.ndarray  # the echo's estimate subtracted, nothing suppressed (the recognizer)


class FarHold:
    """Far blocks held back by a delay. It only changes by `min_change_s` or more: the canceller
    behind it converges again after every shift."""

    def __init__(self, min_change_s: float = MIN_HOLD_CHANGE_S) -> None:
        self._held: deque[np.ndarray] = deque()  # at most `_blocks`, MAX_DELAY_S / 10 ms
        self._blocks = 0
        self._min_change_s = min_change_s

    def follow(self, hold_s: float) -> bool:
        """Hold the far end back by `hold_s` from now on, if that is a change; whether it was."""
        if abs(hold_s - self._blocks * BLOCK / LISTEN_RATE) < self._min_change_s:
            return False
        self._blocks = round(min(hold_s, MAX_DELAY_S) * LISTEN_RATE / BLOCK)
        while len(self._held) > self._blocks:
            self._held.popleft()
        return True

    def shift(self, block: np.ndarray) -> np.ndarray:
        """`block` in, the one of the hold before it out (silence while the hold fills)."""
        self._held.append(block)
        return self._held.popleft() if len(self._held) > self._blocks else np.zeros(BLOCK, np.float32)


class EchoCanceller:
    """One session's canceller. `play()` each reply chunk as it is sent (24 kHz); `process()` the input (16 kHz).

    `play` and `stop` run on the event loop, `process` on the input clock's thread
    (voicebot/serving/input_clock.py): the far-end queue is shared under a lock.
    """

    def __init__(self, reply_rate: int = 24000) -> None:
        from aec_audio_processing import AudioProcessor

        _configure_aec3()
        self._apm = AudioProcessor(enable_aec=True, enable_ns=False, enable_agc=False, enable_vad=False)
        self._apm.set_stream_format(LISTEN_RATE, 1)
        self._apm.set_reverse_stream_format(LISTEN_RATE, 1)
        self._reply_rate = reply_rate
        # Quick (cubic) resampling: it holds nothing back, where HQ's filter holds ~21 ms of each frame
        # until the next, which made the reference run ~36 ms late (an echo path shorter than that,
        # an OBS mix, was beyond cancelling; the first reply got 10-21 dB instead of 25-48 here).
        self._resampler = StreamResampler(reply_rate, LISTEN_RATE, "QQ")
        self._lock = threading.Lock()
        # Resampled reply audio not yet matched with input, with when it was sent if it starts a
        # playout (a new reply, or playback ran dry); None: it plays right after the one before.
        self._far: deque[tuple[np.ndarray, float | None]] = deque()
        self._played_until = float("-inf")  # when the reply audio sent so far ends playing
        self._far_samples = 0
        # Without libspeexdsp the recognizer hears the suppressed output (said at start-up and in /readyz).
        self._linear = LinearCanceller() if linear_canceller_problem() is None else None
        # Far blocks matched with input, waiting out each canceller's hold.
        self._aec3_hold, self._linear_hold = FarHold(), FarHold(LINEAR_HOLD_CHANGE_S)
        self._near_partial = np.zeros(0, np.float32)
        self.tracker = DelayTracker()
        self.far_dropped_samples = 0  # reply audio never matched with input (the far queue was full)
        # Energy of input and output while the bot speaks: their ratio is the echo removed.
        self._near_energy = 0.0
        self._out_energy = 0.0

    @property
    def delay_ms(self) -> float | None:
        return None if self.tracker.delay_s is None else round(self.tracker.delay_s * 1000, 1)

    @property
    def suppressing(self) -> bool:
        """Whether the gate and the VAD hear AEC3's suppressed output now: the reply (or its echo's
        tail) in the input, and not the input itself (`DelayTracker.input_heard`). Read between `process` calls."""
        return self.tracker.reply_recent and not self.tracker.input_heard

    @property
    def far_pending_s(self) -> float:
        """Reply audio sent and not yet matched with input."""
        return self._far_samples / LISTEN_RATE

    @property
    def attenuation_db(self) -> float | None:
        """Input over output energy while the bot spoke (echo plus any speech over it), so far."""
        if self._out_energy <= 0 or self._near_energy <= 0:
            return None
        return round(10 * np.log10(self._near_energy / self._out_energy), 1)

    def play(self, reply: np.ndarray, sent_at: float | None = None) -> None:
        """Reply audio (float32 at `reply_rate`) that the client is about to play, sent at `sent_at` (monotonic; now)."""
        audio = self._resampler.process(reply)
        sent_at = time.monotonic() if sent_at is None else sent_at
        with self._lock:
            starts = sent_at > self._played_until + PLAYOUT_GAP_S
            self._played_until = (sent_at if starts else self._played_until) + len(audio) / LISTEN_RATE
            self._far.append((audio, sent_at if starts else None))
            self._far_samples += len(audio)
            while self._far_samples > MAX_FAR_S * LISTEN_RATE:
                dropped, _ = self._far.popleft()
                self._far_samples -= len(dropped)
                self.far_dropped_samples += len(dropped)

    def stop(self) -> None:
        """The reply was cut (barge-in, interrupt): the client drops what it has not played."""
        with self._lock:
            self._far.clear()
            self._far_samples = 0
            self._played_until = float("-inf")
        self._resampler = StreamResampler(self._reply_rate, LISTEN_RATE, "QQ")

    def _far_block(self, block_at: float | None) -> np.ndarray:
        """The far end matched with the input block that arrived at `block_at` (None: unknown, take the next)."""
        with self._lock:
            block = np.zeros(BLOCK, np.float32)
            filled = consumed = 0
            while filled < BLOCK and self._far:
                head, sent_at = self._far[0]
                if sent_at is not None and block_at is not None:
                    not_yet = round((sent_at - block_at) * LISTEN_RATE) - filled  # of this block, before the playout began
                    if not_yet >= BLOCK - filled:
                        break
                    filled += max(0, not_yet)
                    self._far[0] = (head, None)
                take = min(BLOCK - filled, len(head))
                block[filled : filled + take] = head[:take]
                filled += take
                consumed += take
                if take == len(head):
                    self._far.popleft()
                else:
                    self._far[0] = (head[take:], None)
            self._far_samples -= consumed
            return block

    def _follow_delay(self) -> None:
        if (delay_s := self.tracker.delay_s) is not None:
            self._aec3_hold.follow(delay_s - HOLD_MARGIN_S if delay_s > AEC3_REACH_S else 0.0)
        linear_delay_s = self.tracker.linear_delay_s
        if linear_delay_s is not None and self._linear_hold.follow(max(0.0, linear_delay_s - LINEAR_MARGIN_S)) and self._linear:
            # What MDF learnt before the shift is misplaced (and it took itself for adapted on it):
            # afresh it took 1-2 dB more off a 300 ms path 1.5-2.5 s into the first reply.
            self._linear.reset()

    def process(self, near: np.ndarray, arrived: float | None = None) -> Cancelled:
        """Input (16 kHz float32) whose last sample arrived at `arrived` (monotonic), with the echo
        removed, both ways; at most one 10 ms block is held back."""
        data = np.concatenate([self._near_partial, np.asarray(near, np.float32)])
        n = len(data) // BLOCK * BLOCK
        self._near_partial = data[n:]
        suppressed, linear = np.empty(n, np.float32), np.empty(n, np.float32)
        for start in range(0, n, BLOCK):
            near_block = data[start : start + BLOCK]
            far_block = self._far_block(None if arrived is None else arrived - (len(data) - start) / LISTEN_RATE)
            self.tracker.add(near_block, far_block)
            self._follow_delay()
            aec3_reference, linear_reference = self._aec3_hold.shift(far_block), self._linear_hold.shift(far_block)
            near_pcm = _pcm16(near_block)
            self._apm.process_reverse_stream(_pcm16(aec3_reference).tobytes())
            cleaned = np.frombuffer(self._apm.process_stream(near_pcm.tobytes()), "<i2").astype(np.float32) / 32768.0
            # No echo, or none back yet: the input itself (AEC3 still follows the reply, ready if an echo comes after all).
            heard = near_block if self.tracker.input_heard else cleaned
            suppressed[start : start + BLOCK] = heard
            linear[start : start + BLOCK] = heard if self._linear is None else self._linear.process(near_pcm, _pcm16(linear_reference))
            if np.any(far_block):
                self._near_energy += float(np.dot(near_block, near_block))
                self._out_energy += float(np.dot(heard, heard))
        return Cancelled(suppressed, linear)
