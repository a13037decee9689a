"""Broadcast-safe reply audio: a slow loudness AGC to a target in LUFS, then a true-peak limiter.

    TTS chunk ─► OutputLevel.reply() ─► ReplyLevel.process ─► Framer ─► 200 ms frames ─► session, channel, OBS

Loudness is ITU-R BS.1770 / EBU R128's: K-weighted mean square over 400 ms blocks (75 % overlap),
gated at -70 LUFS and 10 LU under the running level. `LoudnessMeter` measures it on the stream, with
pyloudnorm's K-weighting filters run chunk by chunk (pyloudnorm measures whole buffers only; the
tests measure our output with its `integrated_loudness`). The level it tracks is the gated
blocks' mean power (the integrated loudness) over the first `AGC_SECONDS` of speech, then their
exponential average over that long, kept for the whole session, so the gain moves slowly (no
pumping between words) and a reply starts where the last one ended.

The gain of each chunk is set after the meter has heard the chunk itself (the chunk is its own
look-ahead) and moves from the previous gain evenly in dB, at most `MAX_SLEW_DB_PER_S`, except
before the first measurement, where it starts at the measured gain. It never exceeds
`MAX_GAIN_DB`: near-silence is not boosted into noise.

The limiter keeps the true peak (4x oversampled, as BS.1770's annex 2 measures it) under the
ceiling: the gain needed at each sample is reached by a ramp over the `LOOKAHEAD_MS` before it (so
the limiter holds back that much audio, flushed at the reply's end) and recovers at
`RELEASE_PER_S`. What it takes off the loudness (a peaky voice pushed towards the ceiling loses
some) is measured and made up by the AGC: from the session's first chunk on (a few rounds of a
fixed point on that chunk), then from its running average.
"""

from __future__ import annotations

import numpy as np
import pyloudnorm
from numpy.lib.stride_tricks import sliding_window_view
from scipy.ndimage import minimum_filter1d, uniform_filter1d
from scipy.signal import firwin, lfilter

from voicebot.config.stages import OutputConfig

ABSOLUTE_GATE_LUFS = -70.0
RELATIVE_GATE_LU = 10.0
BLOCK_S, HOP_S = 0.4, 0.1
AGC_SECONDS = 3.0  # the level's time constant, in seconds of gated speech (EBU R128's short-term window)
MAX_GAIN_DB = 20.0
MAX_SLEW_DB_PER_S = 6.0
LOOKAHEAD_MS = 5.0
RELEASE_PER_S = 10.0  # the limiter's gain recovers 10 (linear) a second: from -6 dB in 50 ms
OVERSAMPLE = 4
FIRST_CHUNK_ROUNDS = 4

# The 4x interpolator that measures true peak: scipy's resample_poly(x, 4, 1) filter (a Kaiser
# windowed sinc, beta 5, 10 input samples either side), as its four phase filters: the point at
# phase p from x[i] towards x[i + 1] is x[i - REACH + 1 : i + REACH + 1] @ PHASES[p] (phase 0: x[i]
# itself, times the filter's DC normalisation, 1.0006, as resample_poly gives it).
REACH = 10
_INTERPOLATOR = firwin(2 * REACH * OVERSAMPLE + 1, 1 / OVERSAMPLE, window=("kaiser", 5.0)) * OVERSAMPLE
PHASES = np.stack([_INTERPOLATOR[p::OVERSAMPLE][: 2 * REACH][::-1] for p in range(OVERSAMPLE)])
# No point from x[i] towards x[i + 1] exceeds GAIN_BOUND times the largest sample in its window:
# where even that is under the ceiling, the interpolation is skipped (most of a reply's samples).
GAIN_BOUND = float(np.abs(PHASES).sum(axis=1).max())
# NO_BLAS: the stage runs on the event loop, so its products are numpy's own loops (einsum), never
# BLAS (np.dot, @): OpenBLAS hands a long product to its threads, which on a busy box wait for a
# core. np.dot over a 1 s chunk's 24,000 samples took 4 ms of wall time for 0.01 ms of work
# (a -16 LUFS reply's stage: 8x its CPU cost, bench/output_level.py, 2-core box at load 6).


def db_to_gain(db: float) -> float:
    return 10.0 ** (db / 20.0)


def ramp(start: float, end: float, n: int) -> np.ndarray:
    """n gains from `start` towards `end`, evenly in dB."""
    if start == end:
        return np.full(n, end)
    return start * np.exp(np.arange(n) * (np.log(end / start) / n))


class LoudnessMeter:
    """BS.1770 K-weighted loudness of a stream, as an exponentially weighted, gated level."""

    def __init__(self, rate: int) -> None:
        # pyloudnorm's K-weighting (high shelf, then high pass) for this rate, read from its Meter
        # (the filters it measures with, not a copy of their parameters), as one 4th-order filter
        # (one pass over the audio instead of two) run with kept state.
        stages = [(f.b, f.a) for f in pyloudnorm.Meter(rate)._filters.values()]
        self._b = np.convolve(stages[0][0], stages[1][0])
        self._a = np.convolve(stages[0][1], stages[1][1])
        self._state = np.zeros(len(self._a) - 1)
        self._hop = int(HOP_S * rate)
        self._hop_energy = 0.0  # sum of squares of the hop being filled
        self._hop_filled = 0
        self._hops: list[float] = []  # mean squares of the last BLOCK_S / HOP_S hops: bounded to 4
        self._blocks = 0  # blocks that passed the gates
        self.power: float | None = None  # the tracked level's mean square; None until a block passed the gates

    @property
    def lufs(self) -> float | None:
        return None if self.power is None else -0.691 + 10.0 * np.log10(self.power)

    def feed(self, audio: np.ndarray) -> None:
        weighted, self._state = lfilter(self._b, self._a, audio.astype(np.float64), zi=self._state)
        squares = weighted * weighted
        while len(squares):
            take = min(self._hop - self._hop_filled, len(squares))
            self._hop_energy += float(squares[:take].sum())
            self._hop_filled += take
            squares = squares[take:]
            if self._hop_filled == self._hop:
                self._end_hop()

    def _end_hop(self) -> None:
        self._hops.append(self._hop_energy / self._hop)
        self._hop_energy, self._hop_filled = 0.0, 0
        blocks = round(BLOCK_S / HOP_S)
        if len(self._hops) > blocks:
            self._hops.pop(0)
        if len(self._hops) < blocks:
            return
        block = sum(self._hops) / blocks
        if block <= 0 or -0.691 + 10 * np.log10(block) < ABSOLUTE_GATE_LUFS:
            return
        if self.power is not None and 10 * np.log10(block / self.power) < -RELATIVE_GATE_LU:
            return
        # The mean of the gated blocks (BS.1770's integrated loudness) until AGC_SECONDS of them,
        # then an exponential average over that long.
        self._blocks += 1
        weight = max(1.0 / self._blocks, HOP_S / AGC_SECONDS)
        self.power = block if self.power is None else self.power + weight * (block - self.power)

    def estimate(self, audio: np.ndarray) -> float | None:
        """Before any block has passed the gates: the K-weighted mean square of `audio` (the first
        chunk, shorter than a block), if it is over the absolute gate."""
        power = self.power_of(audio)
        return power if power > 0 and -0.691 + 10 * np.log10(power) >= ABSOLUTE_GATE_LUFS else None

    def power_of(self, audio: np.ndarray) -> float:
        """The K-weighted mean square of `audio` alone (filters from rest, state untouched)."""
        if not len(audio):
            return 0.0
        weighted = lfilter(self._b, self._a, audio.astype(np.float64))
        return float(np.einsum("i,i->", weighted, weighted)) / len(weighted)  # not np.dot: see NO_BLAS


class OutputLevel:
    """One session's output level: the AGC's meter and gain, shared by its replies."""

    def __init__(self, rate: int, config: OutputConfig) -> None:
        self.rate = rate
        self.target_lufs = config.loudness_lufs  # None: no AGC, the limiter only
        self.ceiling = db_to_gain(config.true_peak_dbtp)
        self.meter = LoudnessMeter(rate)
        self.gain: float | None = None  # linear; None until the first measurement
        # K-weighted power into and out of the limiter, decayed over AGC_SECONDS: what it takes off
        # the loudness (peaky speech pushed to the target loses some at the ceiling), made up by the AGC.
        self._limiter_in = self._limiter_out = 0.0

    def reply(self) -> ReplyLevel:
        return ReplyLevel(self)

    def next_gain(self, chunk: np.ndarray) -> float:
        """The gain to reach by the end of `chunk`, once the meter has heard it."""
        if self.target_lufs is None:
            return 1.0
        self.meter.feed(chunk)
        power = self.meter.power if self.meter.power is not None else self.meter.estimate(chunk)
        if power is None:  # silence so far: nothing to measure, nothing to boost
            return self.gain if self.gain is not None else 1.0
        loss_db = -10 * np.log10(self.limiter_loss or 1.0)  # what the limiter takes off, made up here
        wanted_db = min(MAX_GAIN_DB, self.target_lufs - (-0.691 + 10 * np.log10(power)) + loss_db)
        if self.gain is None:
            return db_to_gain(wanted_db)
        current_db = 20 * np.log10(self.gain)
        step = MAX_SLEW_DB_PER_S * len(chunk) / self.rate
        return db_to_gain(float(np.clip(wanted_db, current_db - step, current_db + step)))


    @property
    def limiter_loss(self) -> float | None:
        """The share of K-weighted power the limiter leaves (1: none taken); None before any audio."""
        return self._limiter_out / self._limiter_in if self._limiter_in > 0 else None

    def limited(self, before: np.ndarray, gain: np.ndarray) -> None:
        """The limiter sent `before` with `gain`: note its loss."""
        decay = np.exp(-len(before) / self.rate / AGC_SECONDS)
        power_in = self.meter.power_of(before)
        power_out = power_in if gain.min() == 1.0 else self.meter.power_of(before * gain)
        self._limiter_in = self._limiter_in * decay + power_in * len(before)
        self._limiter_out = self._limiter_out * decay + power_out * len(before)


class ReplyLevel:
    """One reply's pass through the session's AGC and its own limiter (which holds back
    LOOKAHEAD_MS of audio: `flush()` at the reply's end returns it)."""

    def __init__(self, level: OutputLevel) -> None:
        self.level = level
        self._lookahead = max(1, int(level.rate * LOOKAHEAD_MS / 1000))
        self._release = RELEASE_PER_S / level.rate
        self._held = np.zeros(0, np.float64)  # AGC-gained, not yet limited: at most _lookahead samples
        self._before = np.zeros(REACH, np.float64)  # the last samples sent, for the interpolation
        self._limit = 1.0  # the limiter's gain at the last sample sent

    def process(self, chunk: np.ndarray) -> np.ndarray:
        if not len(chunk):
            return chunk
        level, audio = self.level, chunk.astype(np.float64)
        end = level.next_gain(chunk)
        start = end if level.gain is None else level.gain
        gained = np.concatenate([self._held, audio * ramp(start, end, len(audio))])
        sent = max(0, len(gained) - self._lookahead)
        gain = self._limiter_gain(gained)
        if level.target_lufs is not None and level.limiter_loss is None and sent:
            # The limiter's loss is not known yet (the session's first chunk): found on this chunk
            # and made up at once, so the first reply is at the target too. More gain, more loss: a
            # few rounds of the fixed point (each a limiter pass over the chunk) settle it.
            base = end
            for _ in range(FIRST_CHUNK_ROUNDS):
                loss = level.meter.power_of(gained[:sent] * gain[:sent]) / max(level.meter.power_of(gained[:sent]), 1e-20)
                wanted = min(base / np.sqrt(loss), db_to_gain(MAX_GAIN_DB)) if 0.0 < loss < 1.0 else end
                if abs(20 * np.log10(wanted / end)) < 0.05:
                    break
                end = start = wanted
                gained = np.concatenate([self._held, audio * ramp(start, end, len(audio))])
                gain = self._limiter_gain(gained)
        level.gain = end
        out = self._send(gained, gain, sent)
        self._held = gained[sent:]
        return out.astype(np.float32)

    def flush(self) -> np.ndarray:
        held, self._held = self._held, np.zeros(0, np.float64)
        return self._send(held, self._limiter_gain(held), len(held)).astype(np.float32)

    def _send(self, x: np.ndarray, gain: np.ndarray, sent: int) -> np.ndarray:
        """The first `sent` samples of `x` go out with `gain`: the limiter's state moves past them."""
        out = x[:sent] * gain[:sent]
        if sent:
            self.level.limited(x[:sent], gain[:sent])
            self._limit = float(gain[sent - 1])
            self._before = np.concatenate([self._before, out[-REACH:]])[-REACH:]
        return out

    def _limiter_gain(self, x: np.ndarray) -> np.ndarray:
        """The gain that keeps `x` under the ceiling, from where the samples sent left off. Its end
        may be look-ahead (held, limited again next time); what follows `x` is taken as silence
        (true after a flush)."""
        need = self._need(x)
        if need is None:
            if self._limit == 1.0:  # nothing to limit, nothing to recover from
                return np.ones(len(x))
            need = np.ones(len(x))
        attack = need
        if len(need) and need.min() < 1.0:
            # The least need over the look-ahead ahead of each sample, averaged over the look-ahead
            # behind it: a ramp that is down to each sample's need when it reaches it.
            h = self._lookahead
            ahead = minimum_filter1d(np.concatenate([need, np.ones(h)]), h + 1, origin=-(h // 2), mode="nearest")[: len(need)]
            attack = uniform_filter1d(np.concatenate([np.full(h, ahead[0]), ahead]), h + 1, origin=h // 2, mode="nearest")[h:]
        # Recover at most _release a sample, from where the last samples sent left off.
        steps = np.arange(1, len(x) + 1) * self._release
        released = np.minimum.accumulate(np.concatenate([[self._limit], attack - steps]))[1:] + steps
        return np.minimum(attack, released)

    def _need(self, x: np.ndarray) -> np.ndarray | None:
        """The gain each sample needs for its true peak (the largest of the 4x-oversampled signal
        from it to the next sample, as BS.1770's annex 2 measures it) to be under the ceiling: 1
        where it is already; None where every sample is. Interpolated only near samples loud
        enough (GAIN_BOUND) for a point between them to reach the ceiling."""
        ceiling = self.level.ceiling
        padded = np.concatenate([self._before, x, np.zeros(REACH + 1)])
        magnitude = np.abs(padded)
        hot = magnitude * GAIN_BOUND > ceiling  # samples a point near which may reach the ceiling
        if not hot.any():
            return None
        s, n = len(self._before), len(x)
        # mine[k]: the largest point from x[k] towards x[k + 1] (k = n: to the silence after x),
        # interpolated where a hot sample is in its window; elsewhere none can reach the ceiling
        # and the sample itself stands for them.
        mine = magnitude[s : s + n + 1].copy()
        # Interval k's window is padded[s + k - REACH + 1 : s + k + REACH + 1].
        hot_before = np.concatenate([[0], np.cumsum(hot)])  # hot_before[i]: hot samples in padded[:i]
        hot_in_window = hot_before[s + REACH + 1 : s + n + REACH + 2] - hot_before[s - REACH + 1 : s + n - REACH + 2]
        loud = np.flatnonzero(hot_in_window)
        windows = sliding_window_view(padded, 2 * REACH)[loud + s - REACH + 1]
        mine[loud] = np.abs(np.einsum("pr,kr->pk", PHASES, windows)).max(axis=0)  # not PHASES @ windows.T: NO_BLAS
        peaks = np.maximum(mine[:-1], mine[1:])
        if peaks.max(initial=0.0) <= ceiling:
            return None
        return np.minimum(1.0, ceiling / np.maximum(peaks, 1e-12))
