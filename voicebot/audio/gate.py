"""Adaptive noise gate: mute short impulsive bursts (mic bumps, clicks, claps), let speech pass.

The rule we were given is "a chunk whose energy exceeds the background mean + 3 standard deviations
is a burst of noise: mute it for 50 ms". Taken literally it mutes every word louder than the room.
What was meant, and what this does:

* Energy is measured on 5 ms blocks (mean square). The background's mean and standard deviation
  are exponentially weighted statistics (time constant `background_tau_s`) over blocks that are
  not above the threshold, so speech and bursts never raise them. The standard deviation is the
  square root of the weighted variance (ddof=0), kept with West's incremental algorithm.
* A block is "loud" when its energy exceeds mean + 3 std and is at least `min_rise_db` above the
  mean (on a steady background 3 std is barely above the mean; the rise keeps ordinary noise
  fluctuations from muting anything).
* A run of loud blocks is an impulse, and is muted for 50 ms from its onset, when it lasts at most
  `max_burst_ms` and nothing loud follows within the 50 ms lookahead, and no sustained sound
  (speech) ended shortly before it. Anything longer is sustained sound and passes untouched.

Output is delayed by the lookahead (50 ms, so 10 blocks) plus the part of a block not yet filled.
Decisions depend only on block order, so the output is the same for any input chunking.
Memory bound: lookahead + one block of samples.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from voicebot.config import GateConfig

# Sound that ended this recently makes a short loud run part of speech (a word-final plosive
# release after its closure), not an impulse.
SPEECH_HANGOVER_MS = 250.0


@dataclass
class _Block:
    samples: np.ndarray
    loud: bool


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

        # Background statistics: total weight, weighted mean, weighted sum of squared deviations.
        self._weight = 0.0
        self.mean = 0.0
        self._m2 = 0.0
        self.background_blocks = 0

        self._partial = np.zeros(0, np.float32)
        self._pending: deque[_Block] = deque()
        self._blocks_in = 0  # index of the next block to arrive
        self._run = 0  # length of the current run of loud blocks
        self._last_sustained = -10**9  # block index where sustained sound was last seen
        self._mute_left = 0
        self.muted_samples = 0

    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / self._weight) if self._weight else 0.0

    def process(self, audio: np.ndarray) -> np.ndarray:
        """Feed samples; returns the gated samples decided so far (delayed by the lookahead)."""
        data = np.concatenate([self._partial, np.asarray(audio, np.float32)])
        n = len(data) // self.block
        out = []
        if n:
            blocks = data[: n * self.block].reshape(n, self.block)
            energies = np.mean(blocks.astype(np.float64) ** 2, axis=1)
            for samples, energy in zip(blocks, energies):
                self._arrive(samples, float(energy))
                if len(self._pending) > self.lookahead:
                    out.append(self._decide())
        self._partial = data[n * self.block :]
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def flush(self) -> np.ndarray:
        """Decide every pending block (end of stream) and return the rest, partial block included."""
        out = [self._decide() for _ in range(len(self._pending))]
        out.append(self._partial)
        self._partial = np.zeros(0, np.float32)
        return np.concatenate(out)

    def _arrive(self, samples: np.ndarray, energy: float) -> None:
        index = self._blocks_in
        self._blocks_in += 1
        if index < self.warmup_blocks:
            # Assume the first moments are background; only an obvious outlier is kept out.
            loud = self.background_blocks >= 4 and energy > self.mean * self.rise
        else:
            loud = energy > self.mean + self.config.threshold_std * self.std and energy > self.mean * self.rise
        if loud:
            self._run += 1
            if self._run > self.max_burst:
                self._last_sustained = index
        else:
            self._run = 0
            self._add_background(energy)
        self._pending.append(_Block(samples, loud and index >= self.warmup_blocks))

    def _add_background(self, energy: float) -> None:
        # Decay every earlier weight by `decay`, then add this block with weight 1.
        self._weight = self._weight * self.decay + 1.0
        self._m2 *= self.decay
        delta = energy - self.mean
        self.mean += delta / self._weight
        self._m2 += delta * (energy - self.mean)
        self.background_blocks += 1

    def _decide(self) -> np.ndarray:
        """Emit the oldest pending block, gated; the pending blocks after it are its lookahead."""
        index = self._blocks_in - len(self._pending)
        block = self._pending.popleft()
        onset = block.loud and self._mute_left == 0 and self._is_impulse(index)
        if onset:
            self._mute_left = self.mute_blocks
        if self._mute_left:
            self._mute_left -= 1
            self.muted_samples += len(block.samples)
            return np.zeros_like(block.samples)
        return block.samples

    def _is_impulse(self, index: int) -> bool:
        if index - self._last_sustained <= self.hangover:
            return False
        ahead = list(self._pending)  # the blocks after `index`, up to the lookahead
        run = 1
        while run - 1 < len(ahead) and ahead[run - 1].loud:
            run += 1
        if run > self.max_burst:
            return False
        return not any(b.loud for b in ahead[run:])
