"""Host syncs of an LM decode step, counted on CPU: at most one per step whatever the batch (the copy
of the B sampled tokens back), and the device-side RAS draw the same distribution as the official one.

Counted by bench/gpu_counts.py's DeviceWork, the counter bench/gpu_proxy.py prints with (one
counter: what it calls a sync is what these tests bound). bench/gpu_check.sh counts the real ones
on the GPU with torch.cuda.set_sync_debug_mode.
"""

from __future__ import annotations

import collections

import pytest
import torch

from bench.gpu_counts import DeviceWork
from voicebot.tts.cosyvoice2.lm_pool import LMPool
from voicebot.tts.cosyvoice2.bistream import Bistream
from voicebot.tts.cosyvoice2.lm import unistream
from voicebot.tts.cosyvoice2.sampling import RasSampler, greedy, sample_rows

SPEECH = 64



@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded-graph-path"])
@pytest.mark.parametrize("rows", [1, 16])
def test_a_decode_step_waits_for_the_device_once_whatever_the_batch(lm, rows, graphs):
    """Unistream rows (RAS, eos banned early: banned ids on the device) and bistream rows (forced
    fills) and a greedy row, all in one step."""
    pool = LMPool(lm, slots=rows, max_seq_len=256, graphs=graphs)
    opened = []
    for i in range(rows):
        sampler = greedy if i % 5 == 4 else RasSampler(generator=torch.Generator().manual_seed(i))
        row = pool.open(sampler)
        if i % 3 == 2:
            stream = Bistream(lm, 256, [1, 2, 3], list(range(i)))
            program = stream.push(list(range(8, 20)))
        else:
            program = unistream(lm, 256, list(range(3 + i % 4)), [5, 6], list(range(i % 7)))
        pool.start(row, program)
        opened.append(row)
    while any(row.waiting > 1 for row in opened):
        pool.prefill(next(row for row in opened if row.waiting > 1))
    steps = 0
    for _ in range(12):
        decoding = [row for row in opened if row.waiting == 1]
        if not decoding:
            break
        with DeviceWork() as work:
            pool.decode(decoding)
        assert work.syncs == {"Tensor.tolist": 1}, (len(decoding), dict(work.syncs))
        steps += 1
    assert steps >= 10


def test_the_counter_sees_what_waits_for_the_device():
    """DeviceWork counts each kind it claims to (so a step's count of 1 is not the counter's
    blindness), under inference_mode as the pool runs: there a CPU tensor's int() and item() never
    reach a TorchDispatchMode, and a counter of aten calls alone saw 77c2663's per-row int() draws
    as no sync at all (1 per step where there were 5 at one row, 20 at 16)."""
    x = torch.arange(6.0)
    originals = torch.Tensor.tolist, torch.Tensor.__int__, torch.tensor
    with torch.inference_mode(), DeviceWork() as work:
        int(x.max()), x.tolist(), x[x > 2], x.nonzero(), torch.tensor([1, 2], device="cpu"), x[torch.tensor(2)].item()
        x.repeat_interleave(torch.tensor([1, 0, 2, 1, 0, 1])), bool(x[0]), x.cpu()
        x.repeat_interleave(torch.tensor([1, 0, 2, 1, 0, 1]), output_size=5), x.sum(), torch.tensor([3])
        x.to("cpu"), x.to(x), x.to("cpu", non_blocking=True), x.to(torch.float16)
    assert work.syncs == {"Tensor.__int__": 1, "Tensor.tolist": 1, "aten.index.Tensor (boolean mask)": 1,
                          "aten.nonzero.default": 1, "torch.tensor(..., device=)": 1, "Tensor.item": 1,
                          "aten.repeat_interleave.self_Tensor (no output_size)": 1, "Tensor.__bool__": 1,
                          "Tensor.cpu": 1, "Tensor.to(device) from the host": 2}, work.syncs
    assert work.calls > 9
    assert (torch.Tensor.tolist, torch.Tensor.__int__, torch.tensor) == originals  # unpatched after


def test_the_device_draw_is_the_official_distribution():
    """The batched draw (noise always drawn for the redraw) against the official calls (replay), on
    log-probs where the nucleus is 3 ids and id 0 is a recent repeat half the time: the frequencies
    of every id agree within 5 standard errors over 4000 draws each."""
    logp = torch.tensor([0.45, 0.25, 0.12, 0.08, 0.05, 0.03, 0.02]).log()
    histories = [[0, 5, 6], [4, 5, 6]]
    n = 4000
    official, device = collections.Counter(), collections.Counter()
    replay = RasSampler(top_p=0.8, top_k=5, generator=torch.Generator().manual_seed(0), replay=True)
    fast = RasSampler(top_p=0.8, top_k=5, generator=torch.Generator().manual_seed(1))
    for i in range(n):
        official[replay(logp, histories[i % 2])] += 1
        device[fast(logp, histories[i % 2])] += 1
    for token in range(len(logp)):
        p = (official[token] + device[token]) / (2 * n)
        se = (2 * p * (1 - p) / n) ** 0.5 + 1e-9
        assert abs(official[token] - device[token]) / n <= 5 * se, (token, official, device)
    assert official[3] > 0 and device[3] > 0  # the redraw reached outside the nucleus in both


def test_a_batch_of_seeded_rows_draws_what_each_draws_alone():
    torch.manual_seed(0)
    logp = torch.randn(6, 40).log_softmax(-1)
    histories = [list(range(i, i + 9)) for i in range(6)]
    alone = [RasSampler(generator=torch.Generator().manual_seed(i))(logp[i], histories[i]) for i in range(6)]
    batched = sample_rows([RasSampler(generator=torch.Generator().manual_seed(i)) for i in range(6)], logp, histories)
    assert batched == alone
