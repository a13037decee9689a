"""How close our fp32 outputs must be to a reference (the official outputs, or an exact reference
computed in the test), as a fraction of the reference's peak |value|, so that a bound holds on any
fixture set of this format (other sizes, seeds, gains), not only on the one at hand.

Why the peak: fp32 rounds every product and partial sum to 2^-24 of its own magnitude, so the
error two correct implementations reach (they differ in summation order, not in what they sum)
scales with the magnitudes the tensor is made of; an absolute bound fitted to one set's amplitudes
is loose for a louder set and tight for a quieter one. Why these values: mel, speech and source
are the fixture README's fp32 thresholds (mel 1e-4, speech 2e-4, source 1e-3) divided by the peaks
they were set at (6.0, 0.075, 0.16), rounded; logits are looser than its 1e-4 at a peak of 7.8
(see LOGITS). What they protect: on one side, fp32 rounding (another thread count moved the
official outputs by, relative to the peak: logits 1.1e-6, mel 3.5e-7, speech 1.8e-4, source
7.5e-4); on the other, a defect (a wrong mask, position, chunk boundary, weight or seam), which
moves them by 1e-3 to 1e-1 of the peak (the official stream's seams alone: 0.3 of the peak).

Checked on a second set of other sizes and seeds (test_bounds.py: flow width 96, 3 blocks,
estimator 48 channels; HiFT 48 channels; LMs 128 wide × 4 layers and 256 × 8, once also 896 × 24;
random weights drawn as the fixtures' were), fp32 against float64 of the same code, as a fraction
of each bound: mel 0.02,
speech 0.09, source 0.04, logits 0.02 to 0.08 (the 256 × 8 LM). Two fp32 implementations may
differ by the sum of their own errors, so a bound keeps at least twice that.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

# Logits and hidden states, mels and the flow encoder's output: deep stacks of fp32 dot products,
# ~10^2 ulps of the peak. The speech inherits the mel's error amplified by HiFT (the mel's 3e-7
# became 1.8e-4 in the speech); the NSF source's phase is a cumulative sum over every sample, whose
# rounding grows with the utterance's length (these bounds hold for the fixtures' 5 s).
# LOGITS: the fp32 error of a Qwen2 stack grew to 8.4e-6 of the peak at 256 × 8 layers (above), so
# 2e-5 would leave two implementations no room; 1e-4 keeps 6× over it and 10× under a defect.
LOGITS = 1e-4
# HALF_LOGITS: float16 logits against fp32 (a bound, not golden: float16 cannot reproduce them).
# float16 rounds to 2^-11 of a value (4.9e-4), its weights included; it reached 21 to 24 of those
# steps of the peak (fixtures 0.6 %, the second set's LMs 1.0 % and 1.2 %); a defect in the
# half-precision path (an overflow, a norm or softmax left in float16) gives tens of percent.
HALF_LOGITS = 0.02
MEL = 2e-5
SPEECH = 3e-3
SOURCE = 6e-3


def max_error_to_peak(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected| (0 for empty tensors)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return 0.0
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def assert_close_to_peak(actual: torch.Tensor, expected: torch.Tensor, bound: float, what: str = "") -> None:
    error = max_error_to_peak(actual, expected)
    assert error <= bound, f"{what + ': ' if what else ''}max abs error {error:.3g} of the peak > {bound:g}"


# Near-ties: a greedy token is decided by fp32 only where its top-1/top-2 logit margin exceeds twice
# the logit bound (each of the two logits may be off by the bound). At a step within that, a
# correct implementation may take either token, and every later step then differs from the
# official decode; a token test compares up to there and says so, instead of failing or passing
# by the luck of the summation order.


class Margins:
    """Wraps a sampler: each step's top-1/top-2 log-prob margin as the sampler saw it (eos masked
    where it was) and the id it chose (inf where the choice was forced, not an argmax)."""

    def __init__(self, sample) -> None:
        self.sample, self.margins, self.chosen = sample, [], []

    def __call__(self, logp: Tensor, history: list[int]) -> int:
        top2 = logp.topk(2).values
        chosen = self.sample(logp, history)
        self.margins.append((top2[0] - top2[1]).item() if chosen == int(logp.argmax()) else float("inf"))
        self.chosen.append(chosen)
        return chosen


def compared_steps(speech_token_size: int, margins: Margins, tokens: list[int], expected: list[int],
                   expected_logits: Tensor) -> int | None:
    """Tokens equal `expected` up to the first near-tie where they part (the rule above);
    returns how many decode steps are comparable: None for all, else up to and including that near-tie."""
    tie_within = 2 * LOGITS * expected_logits.abs().max().item()
    ties = [i for i, m in enumerate(margins.margins) if m <= tie_within]
    if ties:
        warnings.warn(f"near-tie steps {ties} (top-2 margin ≤ {tie_within:.2g}): tokens there are not decided by fp32")
    parted = next((k for k, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    if parted is None and len(tokens) == len(expected):
        return None
    parted = min(len(tokens), len(expected)) if parted is None else parted
    # the step that chose the token at `parted` (or the stop): fill tokens take steps of their own
    speech_steps = [i for i, t in enumerate(margins.chosen) if t < speech_token_size]
    step = speech_steps[parted] if parted < len(speech_steps) else len(margins.margins) - 1
    assert step in ties, (f"token {parted} (step {step}, margin {margins.margins[step]:.3g} > {tie_within:.2g}) "
                          f"differs from the official one: {tokens[parted:parted + 1]} != {expected[parted:parted + 1]}")
    return step + 1
