"""Where the bot's echo is, and whether there is one: GCC-PHAT between the far end and the input.

AEC3 finds and follows the echo's delay itself within its search range (about 0.5 s here: 500 ms
cancelled 59 dB, 800 ms only 13 dB), so `DelayTracker` measures it too (GCC-PHAT on the last second
of both ends, while the bot speaks); voicebot/audio/echo.py holds the far end back by the estimate
less a margin for a path beyond that range only (an OBS mix with buffering), and the linear
canceller's far end on the tracker's early estimate.

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
over NO_ECHO_WINDOWS of the early windows. Until the input is first not quiet at a new reply's
onset, and after it where it came too late for an echo of a delay under ONSET_SLACK_S less than that
(ONSET_QUICK_S), the input itself too (`input_heard`). Still open: words that start within ~0.35 s
of a reply's first sound (the onset check's window would not reach AEC3_REACH_S) are AEC3's until
the early windows decide (words 0.2-0.3 s in: barge-in 1.3 s after them instead of 0.44), and over a
noise floor the first reply's first ~1.3 s are AEC3's. An echo confirmed (the tracker's delay) is
there for the rest of the session.

Bounds: the tracker keeps `HISTORY_S` of each end.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from voicebot.audio.linear_echo import BLOCK
from voicebot.audio.rates import LISTEN_RATE

MAX_DELAY_S = 1.0  # longest echo path the tracker looks for
HISTORY_S = 2.0  # near: the last second; far: that second plus the longest delay
ESTIMATE_EVERY_S = 1.0
# AEC3 finds a path this long by itself (over a reply's first 3 s, -6 dB: 500 ms cancelled 44 dB, 600 ms
# 11 dB). Within it the far end is never shifted: AEC3 converges again after every shift, and a
# 326-500 ms path, cancelled 40 dB until the tracker's hold moved the reference, leaked and barged in.
# Beyond it the first reply still leaks until the path is confirmed (~3 s; 600-700 ms barged in).
AEC3_REACH_S = 0.55
FAR_ACTIVE_RMS = 1e-3  # about -60 dBFS: below it the bot is silent and there is nothing to measure
QUIET_RMS = FAR_ACTIVE_RMS / 10  # about -80 dBFS: input under it holds no echo anyone would hear
# An echo comes back at the same delay second after second (playout jitter is a few ms); a voice
# over the reply correlates with it by chance, at another lag each time (0.20, 0.24, 0.50 s here).
ECHO_CONFIRM_S = 0.02
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
# ONSET_CHECK_S an echo (a longer path) gives AEC3's output back. Where the window reaches
# AEC3_REACH_S into the playout (an echo would be in it), the input itself from the onset too, AEC3's
# again if the far end explains its first ONSET_QUICK_S, and after ONSET_WINDOW_S the input where what
# came is no echo. Passing the first 0.1 s before any check (0.3 s of quiet) left an echo of 326-500 ms
# unsuppressed for 0.1 s, and the first reply's echo was 16 dB down instead of 40; AEC3's output until
# the 0.2 s check took the first 0.2 s of words 0.5 s into a first reply (-49 dB, barge-in 0.72 s after
# them instead of 0.36).
ONSET_CHECK_S = 0.1
ONSET_WINDOW_S = 0.2
# The input quiet since the playout began, an echo whose onset this is would be of a delay no more than
# ONSET_SLACK_S short of that (its source's first sound under -80 dBFS a few blocks longer, at -20 dB
# and under), so the far end at those delays explains its first ONSET_QUICK_S or it is no echo AEC3
# could cancel. Measured at those delays: an echo (400-700 ms, -6 and -20 dB, rooms with RT60 0.4 and
# 0.8 s) 0.89-1.00 over 20 ms, 0.77-0.99 over 40; six espeak phrases' onsets 0.09-0.81 over 20 ms
# (median 0.29), 0.04-0.63 over 40 (0.23; 0.51 over every delay of a second). Under
# NO_ECHO_CORRELATION, the input itself stays; else AEC3's until the checks above decide, as before.
# 20 ms, not 40: an echo's onset is what passes until then. An echo of 350-500 ms: its first 100 ms
# 31 dB down instead of 64, the first reply's 45-49 dB (34-48 before); never a barge-in (tests/unit/test_echo.py).
# Under NO_ECHO_CORRELATION is few voices' onsets: six espeak phrases 0.4 and 0.5 s into a first reply with no
# echo path (tests/unit/test_echo.py's reply), barge-in heard within 200 ms of no canceller for 7 of 12, one
# never (0.2 and 0.3 s in: 0 of 12). Over 20 ms they reach 0.10-0.81 (median 0.45); echoes' onsets 0.94-1.00,
# 0.83-0.92 in rooms whose tail is 6 dB over the direct path. At 0.85 instead, with words under 0.35 s passed
# as test_echo's 0.3 s xfail describes, 18 of 24 (0.2-0.5 s in) were heard on time, but an echo of 350-550 ms
# under a short first word ('yes', 0.3 s in) then passed after it: 11 of 12 echoes 1-4 dB down over the second
# after the word (was 8-63).
ONSET_QUICK_S = 0.02
ONSET_SLACK_S = 0.15
# Later: this many early windows in a row with no echo, the reply playing over each and over
# AEC3_REACH_S before it (a microphone's noise floor, a user talking from the reply's start).
NO_ECHO_WINDOWS = 3


def _correlation(near: np.ndarray, far: np.ndarray, from_s: float, to_s: float) -> float:
    """The normalised correlation of `near` with `far` (laid out as for `_clear_peak_s`), the best
    at a delay from `from_s` to `to_s`: 1 for an echo alone, about 0 for another sound. Where the far
    end there is over 40 dB quieter than `near` it explains none of it (0)."""
    n, m = len(near), len(far)
    size = 1 << int(np.ceil(np.log2(n + m)))
    dots = np.fft.irfft(np.fft.rfft(far, size) * np.conj(np.fft.rfft(near, size)), size)[: m - n + 1][::-1]  # by delay
    energy = np.cumsum(np.concatenate([[0.0], far.astype(np.float64) ** 2]))
    played = (energy[n:] - energy[:-n])[::-1]  # of the far end at each delay
    near_energy = float(np.dot(near, near))
    lo, hi = max(0, round(from_s * LISTEN_RATE)), min(m - n, round(to_s * LISTEN_RATE))
    if hi < lo or near_energy <= 0:
        return 0.0
    dots, played = np.abs(dots[lo : hi + 1]), played[lo : hi + 1]
    heard = played >= max(near_energy * 1e-4, 1e-12)
    return float(np.max(np.where(heard, dots / np.sqrt(np.maximum(played, 1e-12) * near_energy), 0.0)))


def _echo_correlation(near: np.ndarray, far: np.ndarray) -> tuple[float | None, float]:
    """GCC-PHAT's clear peak, and the correlation there (0 without one)."""
    peak = _clear_peak_s(near, far)
    return peak, 0.0 if peak is None else _correlation(near, far, peak - 0.002, peak + 0.002)


def _clear_peak_s(near: np.ndarray, far: np.ndarray) -> float | None:
    """GCC-PHAT: the delay of `near` behind the end of `far` (which starts MAX_DELAY_S before `near`),
    in seconds; None where the correlation has no clear peak (music or a noisy room gives a flat
    one, and a guess would misalign)."""
    max_lag = round(MAX_DELAY_S * LISTEN_RATE)
    n = 1 << int(np.ceil(np.log2(len(far) + len(near))))
    cross = np.fft.rfft(far, n) * np.conj(np.fft.rfft(near, n))
    corr = np.fft.irfft(cross / (np.abs(cross) + 1e-12), n)
    # far starts max_lag earlier than near, so an echo `delay` samples late peaks at max_lag - delay.
    lags = corr[: max_lag + 1][::-1]  # index = delay in samples
    peak = int(np.argmax(lags))
    return peak / LISTEN_RATE if lags[peak] >= 8 * np.median(np.abs(lags)) else None


class DelayTracker:
    """Echo delay of one session, in seconds: GCC-PHAT between what was played and what came back."""

    def __init__(self) -> None:
        self._near: deque[np.ndarray] = deque(maxlen=round(HISTORY_S * LISTEN_RATE / BLOCK))
        self._far: deque[np.ndarray] = deque(maxlen=round(HISTORY_S * LISTEN_RATE / BLOCK))
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
        # and all its blocks so far, and the input's since it was first not quiet (None: quiet so far).
        self._far_silent_blocks = round(MAX_DELAY_S * LISTEN_RATE / BLOCK)  # since the reply last played
        self._onset_due = False
        self._playout_blocks = self._quiet_blocks = 0
        self._onset_blocks: int | None = None
        self._onset_unproven = False  # no echo taken from the onset on, before the quiet reached AEC3_REACH_S
        self._no_echo_windows = 0  # early windows in a row with no echo at any delay

    @property
    def reply_recent(self) -> bool:
        """The reply played within MAX_DELAY_S: its echo may be in the input now."""
        return self._far_silent_blocks * BLOCK < MAX_DELAY_S * LISTEN_RATE

    @property
    def input_heard(self) -> bool:
        """Whether the gate and the VAD hear the input itself: no echo, or none back yet at a new
        playout's onset (the input quiet since it began: AEC3's output there is its own noise, a bit or
        two, -95 dBFS over digital silence, and Silero's state over that and over the silence differed
        enough to hear words 0.5 s into a first reply 0.32 s later: tests/unit/test_echo.py)."""
        return self.echo_absent or (self._onset_due and self._onset_blocks is None and not self.echo_confirmed)

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
        if self._since_estimate >= ESTIMATE_EVERY_S * LISTEN_RATE and len(self._far) == self._far.maxlen:
            self._since_estimate = 0
            self._estimate()
        # Until the tracker confirms an echo: the linear hold's estimate comes from them (once), and whether there is an echo.
        if not self.echo_confirmed and self._since_early >= EARLY_EVERY_S * LISTEN_RATE:
            self._since_early = 0
            self._early_estimate()

    def _follow_onset(self, near_block: np.ndarray, far_block: np.ndarray) -> None:
        """The onset check: a new playout (the reply silent for MAX_DELAY_S before it) with the input
        quiet since, then the first input that is not quiet against the far end."""
        far_active = np.sqrt(np.mean(far_block**2)) >= FAR_ACTIVE_RMS
        if far_active and self._far_silent_blocks * BLOCK >= MAX_DELAY_S * LISTEN_RATE:
            self._onset_due, self._playout_blocks, self._quiet_blocks, self._onset_blocks = not self.echo_confirmed, 0, 0, None
        self._far_silent_blocks = 0 if far_active else self._far_silent_blocks + 1
        if not self._onset_due or self.echo_confirmed:
            return
        if self._onset_blocks is None:
            self._quiet_blocks += 1
            if np.sqrt(np.mean(near_block**2)) >= QUIET_RMS:
                # Too soon for the window to reach AEC3_REACH_S (a noise floor is never quiet): the early windows decide.
                reach = self._playout_blocks * BLOCK + ONSET_WINDOW_S * LISTEN_RATE >= AEC3_REACH_S * LISTEN_RATE
                self._onset_due, self._onset_blocks = reach, 0
                self._onset_unproven = reach and not self.echo_absent
                self.echo_absent |= reach  # until ONSET_QUICK_S of it is checked
            elif far_active:
                self._playout_blocks += 1
                if self._playout_blocks * BLOCK >= AEC3_REACH_S * LISTEN_RATE:
                    self.echo_absent = True  # so far
            return
        self._onset_blocks += 1
        if (self._onset_blocks + 1) * BLOCK == round(ONSET_QUICK_S * LISTEN_RATE):  # the onset's block and those after it
            quiet_s = self._quiet_blocks * BLOCK / LISTEN_RATE
            explained = _correlation(*self._ends(ONSET_QUICK_S), quiet_s - ONSET_SLACK_S, quiet_s) >= NO_ECHO_CORRELATION
            self.echo_absent = self.echo_absent and not (explained and self._onset_unproven)
        elif self._onset_blocks * BLOCK == round(ONSET_CHECK_S * LISTEN_RATE):
            if _echo_correlation(*self._ends(ONSET_CHECK_S))[1] >= ECHO_CORRELATION:
                self.echo_absent, self._onset_due = False, False
        elif self._onset_blocks * BLOCK >= ONSET_WINDOW_S * LISTEN_RATE:
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
        window, far_len = round(window_s * LISTEN_RATE), round((window_s + MAX_DELAY_S) * LISTEN_RATE)
        near, far = np.concatenate(self._near)[-window:], np.concatenate(self._far)[-far_len:]
        return near, np.pad(far, (far_len - len(far), 0))

    def _estimate(self) -> None:
        near, far = self._ends(ESTIMATE_EVERY_S)
        if np.sqrt(np.mean(far**2)) < FAR_ACTIVE_RMS:
            return
        # No echo means none of any delay up to MAX_DELAY_S: only when the bot spoke in both halves
        # of the far history, not only in the part that a late echo has not come back from yet.
        no_echo = not self.echo_confirmed and min(np.sqrt(np.mean(h**2)) for h in np.array_split(far, 2)) >= FAR_ACTIVE_RMS
        if np.sqrt(np.mean(near**2)) < QUIET_RMS:  # nothing came back at all
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
        reach = far[-round((EARLY_WINDOW_S + AEC3_REACH_S) * LISTEN_RATE):]
        covered = min(np.sqrt(np.mean(h**2)) for h in np.array_split(reach, 2)) >= FAR_ACTIVE_RMS
        self._no_echo_windows = self._no_echo_windows + 1 if covered else 0  # unless one is found below
        enough = self._no_echo_windows >= NO_ECHO_WINDOWS
        if np.sqrt(np.mean(near**2)) < QUIET_RMS:  # nothing came back
            if enough and not self.echo_confirmed:
                self.echo_absent = True
            return
        last, self._last_early_s = self._last_early_s, self._decide_echo(near, far, enough)
        if (self.early_delay_s is None and last is not None and self._last_early_s is not None
                and abs(self._last_early_s - last) <= ECHO_CONFIRM_S):
            self.early_delay_s = self._last_early_s
