"""Speech-token samplers. A sampler maps (log-probs (V,), tokens decoded so far) to the next id.

`RasSampler` is the official repetition-aware sampling (spec §6.3, CosyVoice HEAD "fix ras"). It
draws from its own torch.Generator with the same calls, in the same order and on tensors of the
same sizes as the official code, so a generator seeded like torch.manual_seed(s) replays the
official seeded output.

`sample_rows` samples every row of a batch in one call: the softmax, sort and nucleus cut of all
RAS rows run as one batched op each, and only the draws are per row, each from that row's own
generator with the very call the single-row sampler makes (multinomial over the row's own nucleus).
So a request's tokens do not depend on who else is in the batch, and a seeded row replays the
official output whatever its neighbours.
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
        return sample_rows([self], logp[None], [history])[0]

    def settings(self) -> tuple[float, int, int, float]:
        return self.top_p, self.top_k, self.win_size, self.tau_r

    def _draw(self, probs: Tensor, ids: Tensor, n: int, logp: Tensor, history: Sequence[int]) -> int:
        """One row's draws, given its sorted probs/ids (V,), nucleus size n and log-probs (V,)."""
        # Not renormalised: multinomial normalises, exactly as the official list-of-probs does.
        token = int(ids[probs[:n].multinomial(1, replacement=True, generator=self.generator)])
        if list(history[-self.win_size:]).count(token) >= self.win_size * self.tau_r:
            # A recent repeat: redraw from the whole distribution, without the rejected id.
            logp = logp.clone()
            logp[token] = -float("inf")
            token = int(logp.softmax(0).multinomial(1, replacement=True, generator=self.generator))
        return token


def sample_rows(samplers: Sequence[Sampler], logp: Tensor, histories: Sequence[Sequence[int]]) -> list[int]:
    """The next token of every row: logp (B, V), row b sampled by samplers[b] with histories[b].

    RAS rows sharing top_p/top_k run their nucleus cut batched; any other sampler (greedy, a test's
    stand-in) is called on its row.
    """
    tokens: list[int | None] = [None] * len(samplers)
    groups: dict[tuple, list[int]] = {}
    for b, sampler in enumerate(samplers):
        if isinstance(sampler, RasSampler):
            groups.setdefault(sampler.settings()[:2], []).append(b)
        else:
            tokens[b] = sampler(logp[b], histories[b])
    for (top_p, top_k), rows in groups.items():
        rows_logp = logp[rows] if len(rows) < len(samplers) else logp
        probs, ids = rows_logp.softmax(-1).sort(dim=-1, descending=True, stable=True)
        head = probs[:, :top_k]
        # Keep candidates while the mass *before* each is < top_p: the one crossing top_p is kept.
        mass_before = torch.cat([head.new_zeros(len(rows), 1), head.cumsum(-1)[:, :-1]], dim=-1)
        sizes = (mass_before < top_p).sum(-1).tolist()  # the call's one host sync
        for i, b in enumerate(rows):
            tokens[b] = samplers[b]._draw(head[i], ids[i], sizes[i], logp[b], histories[b])
    return tokens  # type: ignore[return-value]
