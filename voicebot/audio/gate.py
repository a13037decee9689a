"""Adaptive noise gate: mute short impulsive bursts (mic bumps, clicks, claps), let speech pass.

The rule we were given is "a chunk whose energy exceeds the background mean + 3 standard deviations
is a burst of noise: mute it for 50 ms". Taken literally it mutes every word louder than the room.
What was meant, and what this does:

* Energy is measured on 5 ms blocks (mean square). The background's mean and standard deviation
  are exponentially weighted statistics (time constant `background_tau_s`) over quiet blocks away
  from any sustained sound, so speech and bursts never raise them. The standard deviation is the
  square root of the weighted variance (ddof=0), kept with West's incremental algorithm.
* A block above mean + 3 std is active: sound clearly above the background. Active blocks no more
  than 10 ms apart, and within 25 dB of the loudest one so far, form a span (voiced speech rises
  and falls with each pitch period; a click's decaying tail is not new sound).
* A span is an impulse, muted for 50 ms from its onset, when it lasts at most `max_burst_ms`, its
  loudest 1 ms is at least `min_rise_db` above the background mean (a 0.1 ms click barely moves a
  5 ms block), nothing loud follows within the 50 ms lookahead, and no sustained sound (speech)
  ended shortly before it. Every longer span is sustained sound and passes untouched.
* A room that gets louder for good (music starts, a fan is switched on) makes every block active,
  so none would count as background again and the gate would pass everything from then on. When
  no block has counted as background for `relearn_s`, the statistics restart from the quieter
  half of the blocks of that window: speech has pauses, so its quieter half is mostly room; a
  window of loud speech with none only sets the background too high, which mutes less, never more.
  A room that gets much quieter would be learnt by the moving average alone, but slowly: the jump
  inflates the standard deviation too, and a threshold 10 dB high lets small clicks through for
  ten seconds. So when a quarter of the window is 10 dB under the mean, the statistics restart
  from the blocks of the window that are.

A block is decided once the lookahead after it has arrived, but most blocks cannot be muted
whatever follows: only a span's first loud block starts a mute, and only when no sustained sound
came within the hangover before it. A block that no pending block could start a mute over, and
that no mute in progress reaches, is released at once, before it is decided. So the output is
delayed by the lookahead (50 ms, 10 blocks) only from the onset of a possible impulse until it
is decided (a click, the first 50 ms of a word after a pause); in silence, through sustained
sound and at its end, by no more than the part of a block not yet filled. What is released is
exactly what deciding gives (the same samples, the same mutes); only when it leaves changes. The
output has exactly the input's length once flushed, and decisions depend only on block order, so
it is the same for any input chunking. Memory bound: lookahead + one block of samples, and the
energies (floats) of the last `relearn_s` of blocks.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from voicebot.config.stages import GateConfig

# Sound that ended this recently makes a short loud run part of speech (a word-final plosive
# release after its closure), not an impulse.
SPEECH_HANGOVER_MS = 100.0
# Active blocks separated by at most this many quiet blocks belong to one span: the energy of
# voiced speech in 5 ms blocks rises and falls with each pitch period (a low voice, a 40 Hz thump).
MAX_GAP_BLOCKS = 2
# A span goes on only while its blocks are within 25 dB of its loudest: a click's tail ends it.
SPAN_FLOOR = 10 ** (-25 / 10)
# A span still open at the end of the lookahead is an impulse only if it has decayed by 10 dB.
UNDECIDED_DECAY = 10 ** (-10 / 10)
SUB_BLOCKS = 5  # the loudness of a burst is judged on 1 ms sub-blocks
# The room got quieter when a quarter of the last relearn_s of blocks is this far under the mean
# (in steady room noise the lower quartile is within a few dB of it). Checked every 100 ms.
QUIETER = 10 ** (-10 / 10)
QUIETER_CHECK_BLOCKS = 20


@dataclass
class _Block:
    samples: np.ndarray
    energy: float  # mean square over the block
    peak: float  # mean square of its loudest 1 ms
    active: bool  # above mean + 3 std
    span: int | None  # first block of the span it belongs to; None when not part of one


class NoiseGate:
    def __init__(self, config: GateConfig, sample_rate: int = 16000) -> None:
        self.config = config
        self.block = max(1, round(sample_rate * config.block_ms / 1000))
        self.block_s = self.block / sample_rate
        self.lookahead = round(config.lookahead_ms / config.block_ms)
        self.max_burst = max(1, math.floor(config.max_burst_ms / config.block_ms))
        self.mute_blocks = max(1, round(config.mute_ms / config.block_ms))
        self.hangover = round(SPEECH_HANGOVER_MS / config.block_ms)
        self.warmup_blocks = round(config.warmup_ms / config.block_ms)
        self.rise = 10 ** (config.min_rise_db / 10)
        self.decay = math.exp(-self.block_s / config.background_tau_s)
        self.relearn_blocks = max(1, round(config.relearn_s * 1000 / config.block_ms))

        # Background statistics: total weight, weighted mean, weighted sum of squared deviations.
        self._weight = 0.0
        self.mean = 0.0
        self._m2 = 0.0
        self.background_blocks = 0
        self.relearns = 0  # times the background was re-learnt (the room got louder or quieter)
        # Energies of the last relearn_blocks decided blocks (a ring: block i at i % relearn_blocks),
        # and the last block taken as background.
        self._recent = np.zeros(self.relearn_blocks)
        self._last_background = 0

        self._partial = np.zeros(0, np.float32)
        self._pending: deque[_Block] = deque()  # arrived, not yet decided: at most lookahead + 1
        self._released = 0  # of the pending blocks, how many (the first ones) are already out
        self._blocks_in = 0  # index of the next block to arrive
        self._span_start = 0  # first block of the current span
        self._span_peak = 0.0
        self._last_in_span = -10**9
        self._judged_span: int | None = None  # the last span judged for muting
        self._loud_span: int | None = None  # the last span with a loud block
        self._last_sustained = -10**9  # block index where sustained sound was last seen
        self._mute_left = 0
        self.muted_samples = 0

    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / self._weight) if self._weight else 0.0

    def process(self, audio: np.ndarray) -> np.ndarray:
        """Feed samples; returns the gated samples that deciding can no longer change, in order."""
        data = np.concatenate([self._partial, np.asarray(audio, np.float32)])
        n = len(data) // self.block
        out = []
        if n:
            blocks = data[: n * self.block].reshape(n, self.block)
            squares = blocks.astype(np.float64) ** 2
            energies = np.mean(squares, axis=1)
            sub = self.block // SUB_BLOCKS
            peaks = np.mean(squares[:, : sub * SUB_BLOCKS].reshape(n, SUB_BLOCKS, sub), axis=2).max(axis=1)
            for samples, energy, peak in zip(blocks, energies, peaks):
                self._arrive(samples, float(energy), float(peak))
                if len(self._pending) > self.lookahead:
                    out.append(self._decide())
                out.extend(self._release())
        self._partial = data[n * self.block :]
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def flush(self) -> np.ndarray:
        """Decide every pending block (end of stream) and return the rest, partial block included."""
        out = [self._decide() for _ in range(len(self._pending))]
        out.append(self._partial)
        self._partial = np.zeros(0, np.float32)
        return np.concatenate(out)

    def _arrive(self, samples: np.ndarray, energy: float, peak: float) -> None:
        index = self._blocks_in
        self._blocks_in += 1
        if index < self.warmup_blocks:
            # Assume the first moments are background; only an obvious outlier is kept out.
            active = self.background_blocks >= 4 and energy > self.mean * self.rise
        else:
            active = energy > self.mean + self.config.threshold_std * self.std
        span = None
        if active:
            if index - self._last_in_span > MAX_GAP_BLOCKS + 1:
                self._span_start, self._span_peak = index, energy
            if energy >= self._span_peak * SPAN_FLOOR:
                self._span_peak = max(self._span_peak, energy)
                self._last_in_span = index
                span = self._span_start
                if peak > self.mean * self.rise:
                    self._loud_span = span
                if index - span + 1 > self.max_burst:
                    self._last_sustained = index
        self._pending.append(_Block(samples, energy, peak, active, span))

    def _add_background(self, energy: float) -> None:
        # Decay every earlier weight by `decay`, then add this block with weight 1.
        self._weight = self._weight * self.decay + 1.0
        self._m2 *= self.decay
        delta = energy - self.mean
        self.mean += delta / self._weight
        self._m2 += delta * (energy - self.mean)
        self.background_blocks += 1

    def _release(self) -> list[np.ndarray]:
        """The pending blocks, in order from the first not yet out, that deciding cannot mute.

        A mute starts only at a block `_is_impulse` accepts: one in a span, no more than the
        hangover after the last sustained sound. `_last_sustained` only grows, so a block ruled
        out now is ruled out when decided. A block is safe when the mute in progress ends
        before it and no pending block within `mute_blocks` before it (itself included) could
        start one.
        """
        first = self._blocks_in - len(self._pending)  # the index of the oldest pending block
        muted_until = first + self._mute_left  # the mute in progress covers the blocks before this
        out = []
        while self._released < len(self._pending):
            index = first + self._released
            window = range(max(self._released - self.mute_blocks + 1, 0), self._released + 1)
            if index < muted_until or any(self._may_start_mute(first + i, self._pending[i]) for i in window):
                break
            out.append(self._pending[self._released].samples)
            self._released += 1
        return out

    def _may_start_mute(self, index: int, block: _Block) -> bool:
        return block.span is not None and index - self._last_sustained > self.hangover

    def _decide(self) -> np.ndarray:
        """The oldest pending block, gated, when it was not released already (else nothing: it is
        out, and deciding it only moves the statistics on); the pending blocks after it are its
        lookahead."""
        index = self._blocks_in - len(self._pending)
        block = self._pending.popleft()
        released = self._released > 0
        self._released = max(0, self._released - 1)
        if self._mute_left == 0 and self._is_impulse(index, block):
            self._mute_left = self.mute_blocks
        muted = self._mute_left > 0
        self._recent[index % self.relearn_blocks] = block.energy
        if self._is_background(index, block, muted):
            self._add_background(block.energy)
            self._last_background = index
        elif index - self._last_background >= self.relearn_blocks:
            self._relearn(index, float(np.median(self._recent)))  # the room got louder
        if index % QUIETER_CHECK_BLOCKS == 0 and index >= self.relearn_blocks and self._room_got_quieter():
            self._relearn(index, self.mean * QUIETER)
        if not muted:
            return np.zeros(0, np.float32) if released else block.samples
        if released:  # _release's proof is wrong: the stream would carry this block twice
            raise RuntimeError("the noise gate released a block it then muted")
        self._mute_left -= 1
        self.muted_samples += len(block.samples)
        return np.zeros_like(block.samples)

    def _room_got_quieter(self) -> bool:
        """A quarter of the last relearn_s of blocks is QUIETER under the mean: the lower quartile
        (the (n // 4)-th smallest) is under it exactly when more than n // 4 blocks are. Counted
        (one comparison pass, 1.7 µs for 600 blocks), not partitioned (a copy of the window, then
        a selection: 3-16 µs on this project's shared 2-core box), every 100 ms of every session."""
        return np.count_nonzero(self._recent < self.mean * QUIETER) > self.relearn_blocks // 4

    def _relearn(self, index: int, ceiling: float) -> None:
        """Restart the background statistics from the recent blocks at or under `ceiling`, in order."""
        self._weight = self.mean = self._m2 = 0.0
        oldest_first = np.roll(self._recent, -((index + 1) % self.relearn_blocks))
        for energy in oldest_first[oldest_first <= ceiling].tolist():
            self._add_background(energy)
        self._last_background = index
        self.relearns += 1

    def _is_background(self, index: int, block: _Block, muted: bool) -> bool:
        """Non-burst audio away from speech. A loud span (a burst), the tail of one, and the quiet
        ends of words next to sustained sound are all kept out, or the threshold would climb."""
        if muted or (block.active and block.span is None) or abs(index - self._last_sustained) <= self.hangover:
            return False
        return block.span is None or block.span != self._loud_span

    def _is_impulse(self, index: int, block: _Block) -> bool:
        """The first loud block of a short span, with nothing loud after the span in the lookahead."""
        if block.span is None or block.span == self._judged_span or not self._loud(block):
            return False
        self._judged_span = block.span  # a span is judged once, at its first loud block
        if index - self._last_sustained <= self.hangover:
            return False  # within or just after speech (this also catches spans that grow long)
        end, last, peak = 0, block, block.energy  # the span's last block (offset, block), its peak
        for offset, later in enumerate(self._pending, start=1):
            if later.span == block.span:
                end, last, peak = offset, later, max(peak, later.energy)
            elif later.span is not None and self._loud(later):
                return False  # another sound follows: speech, not a lone impulse
        if end + 1 > self.max_burst:
            return False
        # When the span reaches the end of the lookahead it may yet go on. Impulses decay; a word
        # that starts loud and stays loud for 45 ms is speech.
        undecided = len(self._pending) - end <= MAX_GAP_BLOCKS
        return not undecided or last.energy <= peak * UNDECIDED_DECAY

    def _loud(self, block: _Block) -> bool:
        return block.peak > self.mean * self.rise
