"""Speech-token samplers. A sampler maps (log-probs (V,), tokens decoded so far) to the next id.

`RasSampler` is the official repetition-aware sampling (spec §6.3, CosyVoice HEAD "fix ras"). It
draws from its own torch.Generator with the same calls, in the same order and on tensors of the
same sizes as the official code, so a generator seeded like torch.manual_seed(s) replays the
official seeded output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Sampler = Callable[[Tensor, Sequence[int]], int]


def greedy(logp: Tensor, history: Sequence[int]) -> int:
    return int(logp.argmax())


@dataclass
class RasSampler:
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    generator: torch.Generator | None = None  # per request; on the device of the log-probs

    @classmethod
    def from_hparams(cls, sampling: dict[str, Any], generator: torch.Generator | None = None) -> RasSampler:
        """From hparams["llm"]["sampling"] (the yaml's `!name:...ras_sampling` entry)."""
        if not sampling.get("__function__", "").endswith("ras_sampling"):
            raise ValueError(f"unsupported LM sampler {sampling.get('__function__')!r}")
        return cls(sampling["top_p"], sampling["top_k"], sampling["win_size"], sampling["tau_r"], generator)

    def __call__(self, logp: Tensor, history: Sequence[int]) -> int:
        token = self._nucleus(logp)
        if list(history[-self.win_size:]).count(token) >= self.win_size * self.tau_r:
            # A recent repeat: redraw from the whole distribution, without the rejected id.
            logp = logp.clone()
            logp[token] = -float("inf")
            token = int(logp.softmax(0).multinomial(1, replacement=True, generator=self.generator))
        return token

    def _nucleus(self, logp: Tensor) -> int:
        probs, ids = logp.softmax(0).sort(descending=True, stable=True)
        head = probs[: self.top_k]
        # Keep candidates while the mass *before* each is < top_p: the one crossing top_p is kept.
        mass_before = torch.cat([head.new_zeros(1), head.cumsum(0)[:-1]])
        n = int((mass_before < self.top_p).sum())
        # Not renormalised: multinomial normalises, exactly as the official list-of-probs does.
        pick = head[:n].multinomial(1, replacement=True, generator=self.generator)
        return int(ids[pick])
