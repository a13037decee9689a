"""Speech-token samplers. A sampler maps (log-probs (V,), tokens decoded so far) to the next id.

`RasSampler` is the official repetition-aware sampling (spec §6.3, CosyVoice HEAD "fix ras"): a
draw from the top-k nucleus of mass top_p; if that id is already `win_size·tau_r` times among the
last `win_size` outputs, a redraw from the whole distribution without it.

`sample_rows` samples every row of a batch on the device, and the host waits once, for the copy
of the B tokens back: the softmax, sort, nucleus cut, repetition count and banned ids run as
batched ops, and each draw is torch.multinomial's own method made explicit (the argmax of p / E,
E exponential noise: exactly a draw from p normalised). Each row's noise comes from its own
generator in one call per row (k + V exponentials: the nucleus draw and the redraw, drawn whether
the redraw is used or not), so a request's tokens do not depend on who else is in the batch.

That always-drawn redraw noise is the one difference from the official code's random stream (it
draws the redraw's noise only on a repeat, which the host would have to wait for), so a seeded
row is statistically the official sampler but not its seeded output. `RasSampler(replay=True)`
draws exactly as the official code does, with the same calls on the same sizes, so a generator
seeded like torch.manual_seed(s) replays the official seeded output (the golden tests); it costs
host syncs per row and is not for serving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Sampler = Callable[[Tensor, Sequence[int]], int]


def greedy(logp: Tensor, history: Sequence[int]) -> int:
    """The most likely id (sample_rows takes its rows' argmax on the device, batched)."""
    return int(logp.argmax())


def host_to_device(values: Sequence, device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    """A tensor of host values on `device` without the host waiting for the device: on CUDA through
    pinned memory and a non-blocking copy (a plain torch.tensor(..., device=cuda) synchronises the
    stream); elsewhere the tensor itself."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class RasSampler:
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    generator: torch.Generator | None = None  # per request; on the device of the log-probs
    replay: bool = False  # draw as the official code does (seeded golden replay; host syncs per row)

    @classmethod
    def from_hparams(cls, sampling: dict[str, Any], generator: torch.Generator | None = None,
                     replay: bool = False) -> RasSampler:
        """From hparams["llm"]["sampling"] (the yaml's `!name:...ras_sampling` entry)."""
        if not sampling.get("__function__", "").endswith("ras_sampling"):
            raise ValueError(f"unsupported LM sampler {sampling.get('__function__')!r}")
        return cls(sampling["top_p"], sampling["top_k"], sampling["win_size"], sampling["tau_r"], generator, replay)

    def __call__(self, logp: Tensor, history: Sequence[int]) -> int:
        return sample_rows([self], logp[None], [history])[0]

    def settings(self) -> tuple[float, int, int, float]:
        return self.top_p, self.top_k, self.win_size, self.tau_r

    def replay_draw(self, logp: Tensor, history: Sequence[int]) -> int:
        """One row drawn with the official calls: multinomial over the nucleus, then, on a repeat,
        over the whole distribution without the repeated id."""
        probs, ids = logp.softmax(-1).sort(descending=True, stable=True)
        head = probs[: self.top_k]
        n = int((torch.cat([head.new_zeros(1), head.cumsum(-1)[:-1]]) < self.top_p).sum())
        # Not renormalised: multinomial normalises, exactly as the official list-of-probs does.
        token = int(ids[head[:n].multinomial(1, replacement=True, generator=self.generator)])
        if list(history[-self.win_size:]).count(token) >= self.win_size * self.tau_r:
            logp = logp.clone()
            logp[token] = -float("inf")
            token = int(logp.softmax(0).multinomial(1, replacement=True, generator=self.generator))
        return token


def _ras_rows(samplers: Sequence[RasSampler], logp: Tensor, histories: Sequence[Sequence[int]]) -> Tensor:
    """The next token of rows sharing one RAS setting, (R,) on the device: no host sync."""
    top_p, top_k, win, tau_r = samplers[0].settings()
    rows, vocab = logp.shape
    k = min(top_k, vocab)
    probs, ids = logp.softmax(-1).sort(dim=-1, descending=True, stable=True)
    head = probs[:, :k]
    # Keep candidates while the mass *before* each is < top_p: the one crossing top_p is kept.
    mass_before = torch.cat([head.new_zeros(rows, 1), head.cumsum(-1)[:, :-1]], dim=-1)
    nucleus = torch.where(mass_before < top_p, head, 0.0)
    noise = torch.stack([torch.empty(k + vocab, device=logp.device, dtype=torch.float32)
                         .exponential_(generator=s.generator) for s in samplers])
    token = ids.gather(1, (nucleus / noise[:, :k]).argmax(-1, keepdim=True))  # (R, 1)
    # The repeat check against each row's last `win` outputs (-1 pads a shorter history).
    recent = host_to_device([[-1] * (win - len(h[-win:])) + list(h[-win:]) for h in histories], logp.device)
    repeated = (recent == token).sum(-1) >= win * tau_r
    without = logp.scatter(1, token, -float("inf")).softmax(-1)
    redraw = (without / noise[:, k:]).argmax(-1)
    return torch.where(repeated, redraw, token[:, 0])


def sample_rows(samplers: Sequence[Sampler], logp: Tensor, histories: Sequence[Sequence[int]]) -> list[int]:
    """The next token of every row: logp (B, V), row b sampled by samplers[b] with histories[b].

    RAS rows (grouped by setting) and greedy rows are drawn on the device, then copied back in one
    transfer: the step's one host sync. Replaying RAS rows and any other sampler (a test's stand-in)
    are called on their row.
    """
    tokens: list[int | None] = [None] * len(samplers)
    groups: dict[tuple, list[int]] = {}
    for b, sampler in enumerate(samplers):
        if sampler is greedy:
            groups.setdefault(("greedy",), []).append(b)
        elif isinstance(sampler, RasSampler) and not sampler.replay:
            groups.setdefault(sampler.settings(), []).append(b)
        elif isinstance(sampler, RasSampler):
            tokens[b] = sampler.replay_draw(logp[b], histories[b])
        else:
            tokens[b] = sampler(logp[b], histories[b])
    if not groups:
        return tokens  # type: ignore[return-value]
    order, drawn = [], []
    for key, rows in groups.items():
        rows_logp = logp if len(rows) == len(samplers) else logp[host_to_device(rows, logp.device)]
        if key == ("greedy",):
            drawn.append(rows_logp.argmax(-1))
        else:
            drawn.append(_ras_rows([samplers[b] for b in rows], rows_logp, [histories[b] for b in rows]))
        order += rows
    for b, token in zip(order, torch.cat(drawn).tolist()):  # the one host sync
        tokens[b] = token
    return tokens  # type: ignore[return-value]
