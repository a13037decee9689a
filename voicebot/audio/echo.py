"""The bot deaf to its own voice: acoustic echo cancellation of one session's input.

When the reply plays through speakers, or OBS mixes desktop audio into what /obs/audio sends, the
input carries the bot's own voice back, late (playback + capture + network) and attenuated. The
server knows exactly what it sent: each reply frame is the far end, and WebRTC's AEC3 (the
`aec-audio-processing` package) removes it from the near end (the 16 kHz input) before the
gate, the VAD or the recognizer hear it. AEC3 beat speexdsp's canceller by 20-50 dB on the same
echo here (24-62 dB vs 2-8 dB at 50-300 ms delay), and needs no system library.

Timing: the far end is consumed at the input's pace, one 10 ms block per 10 ms of input, from the
moment the server sends it (the client plays each frame after the one before it); the echo then
arrives later by the client's playback latency plus the acoustic and capture path. A reply's
first frame is matched with the input that arrived when it was sent, not with the input the
audio worker happens to be processing then: under load that input is older (it waited in the
session's queue), and the echo would seem later by that wait, past AEC3's range. AEC3 finds and follows that delay itself within its search range
(about 0.5 s here: 500 ms cancelled 59 dB, 800 ms only 13 dB), so `DelayTracker` measures it too
(GCC-PHAT on the last second of both ends, while the bot speaks) and, for a path beyond that
range only (an OBS mix with buffering), holds the far end back by the estimate less a margin. A
path AEC3 reaches is left alone: every shift of its reference makes it converge again, and the
echo leaks meanwhile.

Double talk: AEC3's first seconds of reply audio are its "initial state", where it suppresses
hardest when the user talks over the bot; it is shortened to 0.6 s (`AEC3_FIELD_TRIALS`, WebRTC's
own configuration override, process-wide), so a barge-in over a new reply's echo is heard about
as soon as one with no echo (bench/echo.py).

No echo path (headphones; an OBS mix without desktop audio): AEC3 cancels with a linear filter
that converges on the echo, and until it has converged its suppressor takes the echo to be as loud
as the reply (its default echo-path gain). With no echo there is nothing to converge on, so that
lasts: a user talking over the reply lost 20-65 dB in most 200 ms windows, and barge-in took
about 2 s instead of 0.5 s (bench/echo.py). So the tracker also says when there is no echo
(`DelayTracker.echo_absent`), and the gate and the VAD then hear the input itself; AEC3 keeps its
reference and runs on, so an echo found after all is suppressed from that block on. Silence alone
(a whole second under -80 dBFS while the reply played) decided it once: a user talking in the first
seconds of a session's first reply, or any real microphone's noise floor, never gave that second,
and AEC3 took 13-70 dB off each 200 ms of the words (issue 29). Now it is also where the far end
does not explain the input (GCC-PHAT's peak and the normalised correlation there, under
`NO_ECHO_CORRELATION`): at a new reply's onset (the input quiet since it began: ONSET_CHECK_S) and
over NO_ECHO_WINDOWS of the early windows. Still open: words that start within AEC3_REACH_S of a
reply's first sound lose their first ONSET_WINDOW_S to the suppressor (an echo of that path could
not be told from them sooner), and over a noise floor the first reply's first ~1.3 s are AEC3's.
An echo confirmed (the tracker's delay) is there for the rest of the session.

Two outputs, one for each listener. AEC3's suppressor (its non-linear stage) takes 5-27 dB off
each 100 ms of the first 0.6-0.9 s of a user talking over the reply's echo, and the recognizer made
'' of that. The gate, the VAD and so barge-in need what it leaves: the echo all but gone (a linear
canceller leaves residual echo, which must not barge in). The recognizer needs the words: it gets
the output of a linear canceller, speexdsp's MDF adaptive filter alone (`LinearCanceller`; its
preprocessor, the residual echo suppressor, never runs), fed the same far end, so the echo's
estimate is subtracted and nothing else is touched. AEC3's own linear output (`GetLinearAecOutput`)
is in no PyPI binding (not `aec-audio-processing`, `pywebrtc-audio`, nor livekit's APM). MDF has
no delay search of its own and converges slowly (in time proportional to its length): its filter
covers `LINEAR_FILTER_S`, and the far end is held back by the path less `LINEAR_MARGIN_S`, on an
early estimate of the tracker's (`EARLY_WINDOW_S`, within ~0.75 s of a new reply) until its own
is settled. What MDF learnt is kept from one reply to the next; only a move of its hold starts it
again. Both outputs have the input's sample positions. bench/echo.py --offline, barge-ins 1.5-2.5
s into a first reply: the words lost ~0.9 dB on average in the linear output (~3 dB in its worst
200 ms) where the suppressed one lost 3-15 dB (6-46 dB); the echo under them was 8-17 dB down
(0.2-14 dB before the early hold), 24-28 dB in a second reply's first second (9-23 before; tests/unit/test_echo.py);
the recognizer heard every word of them (92% before).

The utterance's start (issue 29): the endpoint rule decides on the suppressed output, and where
AEC3 takes the first 0.3-1.2 s of the words off (double talk over a first reply, its linear filter
not yet converged: 10-60 dB per 100 ms), it started the utterance, so the recognizer's audio, inside
the words, and the grammar recognizer made '' of the rest (tests/integration/test_turn_taking.py,
about 1 run in 5). What the suppressor leaves of them still stands above its floor: the front end
reaches back over it while the canceller is `suppressing` (voicebot/audio/echo_onset.py, EchoOnset).
Still open: where the suppressor takes the first words all the way down to its floor (0.3 s of
them over a 180 ms path, tests/unit/test_echo.py), nothing of them rises for it to find.

Bounds: unplayed far end at most `MAX_FAR_S` (more is dropped oldest first and counted); the
tracker keeps `HISTORY_S` of each end; each hold at most `MAX_DELAY_S` of far blocks; the input
waits at most one 10 ms block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import time
import weakref
from collections import deque
from typing import NamedTuple

import numpy as np

from voicebot.audio.resample import StreamResampler

SAMPLE_RATE = 16000
BLOCK = 160  # AEC3 works on 10 ms blocks
MAX_FAR_S = 2.0  # pacing keeps reply audio at most lead_ms (400 ms by default) ahead of playback
MAX_DELAY_S = 1.0  # longest echo path the tracker looks for
HISTORY_S = 2.0  # near: the last second; far: that second plus the longest delay
ESTIMATE_EVERY_S = 1.0
HOLD_MARGIN_S = 0.25  # the far end is held back by the estimate less this: AEC3 then finds the rest itself
# AEC3 finds a path this long by itself (over a reply's first 3 s, -6 dB: 500 ms cancelled 44 dB, 600 ms
# 11 dB). Within it the far end is never shifted: AEC3 converges again after every shift, and a
# 326-500 ms path, cancelled 40 dB until the tracker's hold moved the reference, leaked and barged in.
# Beyond it the first reply still leaks until the path is confirmed (~3 s; 600-700 ms barged in).
AEC3_REACH_S = 0.55
MIN_HOLD_CHANGE_S = 0.06  # AEC3 re-converges after every shift: only follow real changes
# A frame sent this long after the audio before it should have finished playing starts a new
# playout (the client ran dry). Not less: the resampler holds back ~21 ms of each frame until the next.
PLAYOUT_GAP_S = 0.05
FAR_ACTIVE_RMS = 1e-3  # about -60 dBFS: below it the bot is silent and there is nothing to measure
# An echo comes back at the same delay second after second (playout jitter is a few ms); a voice
# over the reply correlates with it by chance, at another lag each time (0.20, 0.24, 0.50 s here).
ECHO_CONFIRM_S = 0.02
# AEC3's "initial state" (2.5 s of reply audio, restarted when it detects an echo path change)
# suppresses far more during double talk: a user talking over the first seconds of a reply lost
# the start of the words, and barge-in came 0.5-1.7 s later than with no echo (bench/echo.py).
# 0.6 s of it: no later than a frame. None at all let a "300 ms" echo barge in live last time,
# perhaps the hold shift that AEC3_REACH_S now avoids (that path measures 304-348 ms); not tried again.
AEC3_FIELD_TRIALS = b"WebRTC-Aec3UseDot6SecondsInitialStateDuration/Enabled/"
# The linear canceller's filter: 16 blocks, 160 ms of echo path. MDF adapts too slowly for a new
# reply's first seconds (its step is normalised over the whole filter, and set by an estimate of
# the echo left that itself takes ~2 s to follow): with 250 ms of filter a 150 ms -6 dB path was
# 2-7 dB down 0.5-2.5 s into the first reply, and a 300 ms one, beyond it until the tracker's hold
# (~3 s), 0 dB. So the far end is held back until the direct path sits LINEAR_MARGIN_S into the
# filter, on the tracker's early estimate, from ~0.75 s into the reply; the room's first ~120 ms
# fit behind it. bench/echo.py --offline (barge-ins 1.5-2.5 s into 3 first replies): the recognizer
# heard 92% of the words before (the echo under them 0.2-0.4 dB down at 300 ms, 7-10 at 150 ms),
# 98% with the early hold and 250 ms of filter, all of them with 160 ms (8-11 dB down at 300 ms,
# 9-12 at 150 ms). 80-120 ms took 1-3 dB more, but off a pure delay: a room's tail needs the length.
LINEAR_FILTER_S = 0.16
LINEAR_MARGIN_S = 0.04  # the estimate is within a few ms, the hold a whole block, and it moves by LINEAR_HOLD_CHANGE_S
LINEAR_HOLD_CHANGE_S = 0.03  # MDF reset and converging again costs less than a path 60 ms off in a short filter
# The linear hold's estimate, until the tracker's own: GCC-PHAT on half a second, every quarter
# second, found every bench/echo.py path (50-700 ms, -6 to -20 dB, a voice over it) from 0.5-0.75 s
# into the first reply, where the tracker's on ESTIMATE_EVERY_S confirms at ~3 s. Two in a row at
# one delay, as for the tracker's. AEC3 keeps the tracker's own: a wrong hold there leaks the echo
# into barge-in, one here only into the recognizer.
EARLY_WINDOW_S = 0.5
EARLY_EVERY_S = 0.25
LINEAR_TRUSTS_ESTIMATES = 3  # the median of 3 moves with no one estimate
# No echo, decided from correlation rather than silence (a user talking, or a microphone's noise
# floor, is never the whole silent second `_estimate` needs). GCC-PHAT's clear peak is no proof of
# an echo: between a voice and the reply it peaked at chance lags in most windows (espeak voices,
# tests/unit/test_echo.py). What is: the far end at that lag explains the input, their normalised
# correlation. Measured on 0.2-0.5 s windows: an echo alone (a pure delay: an OBS mix) 0.97-1.00; in
# a synthetic room (exponential tail, RT60 0.2-0.8 s) 0.67-0.95 with the direct path as loud as the
# tail or louder, 0.21-0.84 with it 6 dB under; a voice over no echo 0.01-0.32. Between the two
# bounds nothing is decided (AEC3 stays on); an echo under a louder voice falls under the lower one
# (0.11-0.33 20 dB under it), so the user talking over it hears the input itself: the reply is cut.
NO_ECHO_CORRELATION = 0.2
ECHO_CORRELATION = 0.4
# At the onset of a new playout, the input quiet (under -80 dBFS) so far. Quiet over AEC3_REACH_S
# of its audio: no echo AEC3 could cancel, so none is taken to be there, and a user who starts
# talking is heard from the first word; what comes is checked against the far end, and after
# ONSET_CHECK_S an echo (a longer path) gives AEC3's output back. Sooner (0.3 s of quiet left an
# echo of 326-500 ms unsuppressed for the check's 0.1 s, and the first reply's echo was 16 dB down
# instead of 40): AEC3's output until ONSET_WINDOW_S of what came is checked, and then the input
# where it is no echo, if the window reaches AEC3_REACH_S into the playout (an echo would be in it).
ONSET_CHECK_S = 0.1
ONSET_WINDOW_S = 0.2
# Later: this many early windows in a row with no echo, the reply playing over each and over
# AEC3_REACH_S before it (a microphone's noise floor, a user talking from the reply's start).
NO_ECHO_WINDOWS = 3
SPEEX_ECHO_SET_SAMPLING_RATE = 24  # speex_echo.h

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


SPEEXDSP_MISSING = ("libspeexdsp is not installed (Debian: libspeexdsp1; scripts/setup installs it): the recognizer "
                    "hears AEC3's suppressed output, which loses the first words spoken over the bot's echo")


@functools.cache
def _speexdsp() -> ctypes.CDLL | None:
    """The system's libspeexdsp, looked up once (find_library runs ldconfig); None where it is missing."""
    path = ctypes.util.find_library("speexdsp")
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    lib.speex_echo_state_init.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.speex_echo_state_init.restype = ctypes.c_void_p
    lib.speex_echo_ctl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.speex_echo_cancellation.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.speex_echo_cancellation.restype = None
    lib.speex_echo_state_destroy.argtypes = [ctypes.c_void_p]
    lib.speex_echo_state_reset.argtypes = [ctypes.c_void_p]
    return lib


def linear_canceller_problem() -> str | None:
    """Why the recognizer cannot hear the linear canceller (start-up log, /readyz); None when it can."""
    return SPEEXDSP_MISSING if _speexdsp() is None else None


def _pcm16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")


class Cancelled(NamedTuple):
    """One stretch of input, echo-cancelled twice, at the same sample positions."""

    suppressed: np.ndarray  # AEC3's: the echo all but gone, and the start of speech over it cut (gate, VAD)
    linear: np.ndarray  # the echo's estimate subtracted, nothing suppressed (the recognizer)


class LinearCanceller:
    """speexdsp's MDF adaptive filter on 10 ms blocks: the echo it predicts from the far end, subtracted."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self._lib = lib or _speexdsp()
        if self._lib is None:
            raise RuntimeError(SPEEXDSP_MISSING)
        lib = self._lib
        self._state = lib.speex_echo_state_init(BLOCK, round(LINEAR_FILTER_S * SAMPLE_RATE))
        rate = ctypes.c_int(SAMPLE_RATE)
        lib.speex_echo_ctl(self._state, SPEEX_ECHO_SET_SAMPLING_RATE, ctypes.byref(rate))
        weakref.finalize(self, lib.speex_echo_state_destroy, self._state)
        self._out = np.zeros(BLOCK, "<i2")

    def process(self, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        """One block of each end, int16; the near end less the echo, float32."""
        near, far = np.ascontiguousarray(near), np.ascontiguousarray(far)
        self._lib.speex_echo_cancellation(self._state, near.ctypes.data, far.ctypes.data, self._out.ctypes.data)
        return self._out.astype(np.float32) / 32768.0

    def reset(self) -> None:
        """Start adapting afresh (the far end was shifted: what the filter learnt is misplaced)."""
        self._lib.speex_echo_state_reset(self._state)


class FarHold:
    """Far blocks held back by a delay. It only changes by `min_change_s` or more: the canceller
    behind it converges again after every shift."""

    def __init__(self, min_change_s: float = MIN_HOLD_CHANGE_S) -> None:
        self._held: deque[np.ndarray] = deque()  # at most `_blocks`, MAX_DELAY_S / 10 ms
        self._blocks = 0
        self._min_change_s = min_change_s

    def follow(self, hold_s: float) -> bool:
        """Hold the far end back by `hold_s` from now on, if that is a change; whether it was."""
        if abs(hold_s - self._blocks * BLOCK / SAMPLE_RATE) < self._min_change_s:
            return False
        self._blocks = round(min(hold_s, MAX_DELAY_S) * SAMPLE_RATE / BLOCK)
        while len(self._held) > self._blocks:
            self._held.popleft()
        return True

    def shift(self, block: np.ndarray) -> np.ndarray:
        """`block` in, the one of the hold before it out (silence while the hold fills)."""
        self._held.append(block)
        return self._held.popleft() if len(self._held) > self._blocks else np.zeros(BLOCK, np.float32)


def _correlation(near: np.ndarray, far: np.ndarray, delay_s: float) -> float:
    """The normalised correlation of `near` with `far` `delay_s` behind it (laid out as for
    `_clear_peak_s`), the best within 2 ms of it: 1 for an echo alone, about 0 for another sound."""
    best = 0.0
    for lag in range(round(delay_s * SAMPLE_RATE) - 32, round(delay_s * SAMPLE_RATE) + 33, 2):
        end = len(far) - lag
        if lag < 0 or end - len(near) < 0:
            continue
        played = far[end - len(near) : end]
        best = max(best, abs(float(np.dot(near, played))) / (float(np.linalg.norm(near) * np.linalg.norm(played)) + 1e-12))
    return best


def _echo_correlation(near: np.ndarray, far: np.ndarray) -> tuple[float | None, float]:
    """GCC-PHAT's clear peak, and the correlation there (0 without one)."""
    peak = _clear_peak_s(near, far)
    return peak, 0.0 if peak is None else _correlation(near, far, peak)


def _clear_peak_s(near: np.ndarray, far: np.ndarray) -> float | None:
    """GCC-PHAT: the delay of `near` behind the end of `far` (which starts MAX_DELAY_S before `near`),
    in seconds; None where the correlation has no clear peak (music or a noisy room gives a flat
    one, and a guess would misalign)."""
    max_lag = round(MAX_DELAY_S * SAMPLE_RATE)
    n = 1 << int(np.ceil(np.log2(len(far) + len(near))))
    cross = np.fft.rfft(far, n) * np.conj(np.fft.rfft(near, n))
    corr = np.fft.irfft(cross / (np.abs(cross) + 1e-12), n)
    # far starts max_lag earlier than near, so an echo `delay` samples late peaks at max_lag - delay.
    lags = corr[: max_lag + 1][::-1]  # index = delay in samples
    peak = int(np.argmax(lags))
    return peak / SAMPLE_RATE if lags[peak] >= 8 * np.median(np.abs(lags)) else None


class DelayTracker:
    """Echo delay of one session, in seconds: GCC-PHAT between what was played and what came back."""

    def __init__(self) -> None:
        self._near: deque[np.ndarray] = deque(maxlen=round(HISTORY_S * SAMPLE_RATE / BLOCK))
        self._far: deque[np.ndarray] = deque(maxlen=round(HISTORY_S * SAMPLE_RATE / BLOCK))
        self._since_estimate = 0
        self._since_early = 0
        # The median of the last few estimates: one window can fool GCC-PHAT (the end of a reply,
        # a repeated phrase) without moving the reported delay.
        self._recent: deque[float] = deque(maxlen=5)
        self.delay_s: float | None = None
        self.estimates = 0
        # The reply played over a whole window and nothing came back, and no echo has been
        # confirmed (two estimates in a row at one delay) in this session.
        self.echo_absent = False
        self.echo_confirmed = False
        self._last_peak_s: float | None = None
        # Until delay_s is known: the first two early estimates in a row at one delay (the linear
        # hold only). Kept: a voice over the reply made two overlapping windows agree on a chance
        # lag (0.53 s, 0.95 s of a 50 ms path) and moved the hold under the very words it was for.
        self.early_delay_s: float | None = None
        self._last_early_s: float | None = None
        # The onset check, once a playout: whether it is still to come, the playout's audible blocks
        # so far, and the input's since it was first not quiet (None: quiet so far).
        self._far_silent_blocks = round(MAX_DELAY_S * SAMPLE_RATE / BLOCK)  # since the reply last played
        self._onset_due = False
        self._playout_blocks = 0
        self._onset_blocks: int | None = None
        self._no_echo_windows = 0  # early windows in a row with no echo at any delay

    @property
    def reply_recent(self) -> bool:
        """The reply played within MAX_DELAY_S: its echo may be in the input now."""
        return self._far_silent_blocks * BLOCK < MAX_DELAY_S * SAMPLE_RATE

    @property
    def linear_delay_s(self) -> float | None:
        """The delay the linear canceller's hold follows: the early one until the tracker's median
        has LINEAR_TRUSTS_ESTIMATES behind it (a first median of one was a voice's chance lag: a
        150 ms path read 80 ms under a barge-in, and the hold moved under the words twice)."""
        if self.early_delay_s is not None and self.estimates < LINEAR_TRUSTS_ESTIMATES:
            return self.early_delay_s
        return self.delay_s

    def add(self, near_block: np.ndarray, far_block: np.ndarray) -> None:
        self._near.append(near_block)
        self._far.append(far_block)
        self._since_estimate += BLOCK
        self._since_early += BLOCK
        self._follow_onset(near_block, far_block)
        if self._since_estimate >= ESTIMATE_EVERY_S * SAMPLE_RATE and len(self._far) == self._far.maxlen:
            self._since_estimate = 0
            self._estimate()
        # Until the tracker confirms an echo: the linear hold's estimate comes from them (once), and whether there is an echo.
        if not self.echo_confirmed and self._since_early >= EARLY_EVERY_S * SAMPLE_RATE:
            self._since_early = 0
            self._early_estimate()

    def _follow_onset(self, near_block: np.ndarray, far_block: np.ndarray) -> None:
        """The onset check: a new playout (the reply silent for MAX_DELAY_S before it) with the input
        quiet since, then the first input that is not quiet against the far end."""
        far_active = np.sqrt(np.mean(far_block**2)) >= FAR_ACTIVE_RMS
        if far_active and self._far_silent_blocks * BLOCK >= MAX_DELAY_S * SAMPLE_RATE:
            self._onset_due, self._playout_blocks, self._onset_blocks = not self.echo_confirmed, 0, None
        self._far_silent_blocks = 0 if far_active else self._far_silent_blocks + 1
        if not self._onset_due or self.echo_confirmed:
            return
        if self._onset_blocks is None:
            if np.sqrt(np.mean(near_block**2)) >= FAR_ACTIVE_RMS / 10:
                # Too soon for the window to reach AEC3_REACH_S (a noise floor is never quiet): the early windows decide.
                reach = self._playout_blocks * BLOCK + ONSET_WINDOW_S * SAMPLE_RATE >= AEC3_REACH_S * SAMPLE_RATE
                self._onset_due, self._onset_blocks = reach, 0
            elif far_active:
                self._playout_blocks += 1
                if self._playout_blocks * BLOCK >= AEC3_REACH_S * SAMPLE_RATE:
                    self.echo_absent = True  # so far
            return
        self._onset_blocks += 1
        if self._onset_blocks * BLOCK == round(ONSET_CHECK_S * SAMPLE_RATE):
            if _echo_correlation(*self._ends(ONSET_CHECK_S))[1] >= ECHO_CORRELATION:
                self.echo_absent, self._onset_due = False, False
        elif self._onset_blocks * BLOCK >= ONSET_WINDOW_S * SAMPLE_RATE:
            self._onset_due = False
            self.echo_absent = _echo_correlation(*self._ends(ONSET_WINDOW_S))[1] < NO_ECHO_CORRELATION  # not sure: AEC3's

    def _decide_echo(self, near: np.ndarray, far: np.ndarray, enough: bool) -> float | None:
        """Whether `near` is an echo of `far`, into echo_absent: an echo, AEC3's output again; none,
        and `enough` windows of none to say so, the input's own. Returns GCC-PHAT's clear peak."""
        peak, correlation = _echo_correlation(near, far)
        if correlation >= ECHO_CORRELATION:
            self.echo_absent, self._no_echo_windows = False, 0
        elif correlation >= NO_ECHO_CORRELATION:
            self._no_echo_windows = 0  # not sure: as it was
        elif enough and not self.echo_confirmed:
            self.echo_absent = True
        return peak

    def _ends(self, window_s: float) -> tuple[np.ndarray, np.ndarray]:
        """The last `window_s` of the near end and that plus MAX_DELAY_S of the far end (zeros before the session)."""
        window, far_len = round(window_s * SAMPLE_RATE), round((window_s + MAX_DELAY_S) * SAMPLE_RATE)
        near, far = np.concatenate(self._near)[-window:], np.concatenate(self._far)[-far_len:]
        return near, np.pad(far, (far_len - len(far), 0))

    def _estimate(self) -> None:
        near, far = self._ends(ESTIMATE_EVERY_S)
        if np.sqrt(np.mean(far**2)) < FAR_ACTIVE_RMS:
            return
        # No echo means none of any delay up to MAX_DELAY_S: only when the bot spoke in both halves
        # of the far history, not only in the part that a late echo has not come back from yet.
        no_echo = not self.echo_confirmed and min(np.sqrt(np.mean(h**2)) for h in np.array_split(far, 2)) >= FAR_ACTIVE_RMS
        if np.sqrt(np.mean(near**2)) < FAR_ACTIVE_RMS / 10:  # nothing came back at all
            self.echo_absent |= no_echo
            return
        # No clear peak is not taken for no echo: a real echo in a noisy room, or under music, can
        # miss it (bench/echo.py: a 300 ms -20 dB echo once did, and without a reference it barged in).
        last, self._last_peak_s = self._last_peak_s, _clear_peak_s(near, far)
        if self._last_peak_s is None:
            return
        if last is not None and abs(self._last_peak_s - last) <= ECHO_CONFIRM_S:
            self.echo_confirmed, self.echo_absent = True, False
        if not self.echo_confirmed:
            return  # one peak alone may be a voice over the reply: no delay from it
        self._recent.append(self._last_peak_s)
        self.delay_s = float(np.median(self._recent))
        self.estimates += 1

    def _early_estimate(self) -> None:
        near, far = self._ends(EARLY_WINDOW_S)
        if np.sqrt(np.mean(far**2)) < FAR_ACTIVE_RMS:
            return  # the bot is silent: the last peak still stands
        # An echo of any delay AEC3 reaches would be in this window: the reply played over it and before it.
        reach = far[-round((EARLY_WINDOW_S + AEC3_REACH_S) * SAMPLE_RATE):]
        covered = min(np.sqrt(np.mean(h**2)) for h in np.array_split(reach, 2)) >= FAR_ACTIVE_RMS
        self._no_echo_windows = self._no_echo_windows + 1 if covered else 0  # unless one is found below
        enough = self._no_echo_windows >= NO_ECHO_WINDOWS
        if np.sqrt(np.mean(near**2)) < FAR_ACTIVE_RMS / 10:  # nothing came back
            if enough and not self.echo_confirmed:
                self.echo_absent = True
            return
        last, self._last_early_s = self._last_early_s, self._decide_echo(near, far, enough)
        if (self.early_delay_s is None and last is not None and self._last_early_s is not None
                and abs(self._last_early_s - last) <= ECHO_CONFIRM_S):
            self.early_delay_s = self._last_early_s


class EchoCanceller:
    """One session's canceller. `play()` each reply chunk as it is sent (24 kHz); `process()` the input (16 kHz).

    `play` and `stop` run on the event loop, `process` on the audio worker: the far-end queue is
    shared under a lock.
    """

    def __init__(self, reply_rate: int = 24000) -> None:
        from aec_audio_processing import AudioProcessor

        _configure_aec3()
        self._apm = AudioProcessor(enable_aec=True, enable_ns=False, enable_agc=False, enable_vad=False)
        self._apm.set_stream_format(SAMPLE_RATE, 1)
        self._apm.set_reverse_stream_format(SAMPLE_RATE, 1)
        self._reply_rate = reply_rate
        # Quick (cubic) resampling: it holds nothing back, where HQ's filter holds ~21 ms of each frame
        # until the next, which made the reference run ~36 ms late (an echo path shorter than that,
        # an OBS mix, was beyond cancelling; the first reply got 10-21 dB instead of 25-48 here).
        self._resampler = StreamResampler(reply_rate, SAMPLE_RATE, "QQ")
        self._lock = threading.Lock()
        # Resampled reply audio not yet matched with input, with when it was sent if it starts a
        # playout (a new reply, or playback ran dry); None: it plays right after the one before.
        self._far: deque[tuple[np.ndarray, float | None]] = deque()
        self._played_until = float("-inf")  # when the reply audio sent so far ends playing
        self._far_samples = 0
        # Without libspeexdsp the recognizer hears the suppressed output (said at start-up and in /readyz).
        self._linear = None if (lib := _speexdsp()) is None else LinearCanceller(lib)
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
        tail) in the input, and an echo not ruled out. Read between `process` calls."""
        return self.tracker.reply_recent and not self.tracker.echo_absent

    @property
    def far_pending_s(self) -> float:
        """Reply audio sent and not yet matched with input."""
        return self._far_samples / SAMPLE_RATE

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
            self._played_until = (sent_at if starts else self._played_until) + len(audio) / SAMPLE_RATE
            self._far.append((audio, sent_at if starts else None))
            self._far_samples += len(audio)
            while self._far_samples > MAX_FAR_S * SAMPLE_RATE:
                dropped, _ = self._far.popleft()
                self._far_samples -= len(dropped)
                self.far_dropped_samples += len(dropped)

    def stop(self) -> None:
        """The reply was cut (barge-in, interrupt): the client drops what it has not played."""
        with self._lock:
            self._far.clear()
            self._far_samples = 0
            self._played_until = float("-inf")
        self._resampler = StreamResampler(self._reply_rate, SAMPLE_RATE, "QQ")

    def _far_block(self, block_at: float | None) -> np.ndarray:
        """The far end matched with the input block that arrived at `block_at` (None: unknown, take the next)."""
        with self._lock:
            block = np.zeros(BLOCK, np.float32)
            filled = consumed = 0
            while filled < BLOCK and self._far:
                head, sent_at = self._far[0]
                if sent_at is not None and block_at is not None:
                    not_yet = round((sent_at - block_at) * SAMPLE_RATE) - filled  # of this block, before the playout began
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
            far_block = self._far_block(None if arrived is None else arrived - (len(data) - start) / SAMPLE_RATE)
            self.tracker.add(near_block, far_block)
            self._follow_delay()
            aec3_reference, linear_reference = self._aec3_hold.shift(far_block), self._linear_hold.shift(far_block)
            near_pcm = _pcm16(near_block)
            self._apm.process_reverse_stream(_pcm16(aec3_reference).tobytes())
            cleaned = np.frombuffer(self._apm.process_stream(near_pcm.tobytes()), "<i2").astype(np.float32) / 32768.0
            # No echo: the input itself (AEC3 still follows the reply, ready if an echo comes after all).
            heard = near_block if self.tracker.echo_absent else cleaned
            suppressed[start : start + BLOCK] = heard
            linear[start : start + BLOCK] = heard if self._linear is None else self._linear.process(near_pcm, _pcm16(linear_reference))
            if np.any(far_block):
                self._near_energy += float(np.dot(near_block, near_block))
                self._out_energy += float(np.dot(heard, heard))
        return Cancelled(suppressed, linear)
