"""Host syncs of an LM decode step, counted on CPU: at most one per step whatever the batch (the copy
of the B sampled tokens back), and the device-side RAS draw the same distribution as the official one.

On CUDA the host waits for the device at every read of a device value (item(), int(), tolist(),
.cpu(), numpy()), at ops whose output size depends on values (nonzero, boolean-mask indexing,
masked_select) and at every blocking host-to-device copy (torch.tensor(..., device=cuda)). On CPU
nothing waits, so `HostSyncs` counts the calls that would: the aten ops through a
TorchDispatchMode, the Python-level reads and tensor constructions through patched entry points.
bench/gpu_check.sh counts the real ones on the GPU with torch.cuda.set_sync_debug_mode.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from voicebot.serving.lm_pool import LMPool
from voicebot.tts.cosyvoice2.bistream import Bistream
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, Qwen2Config, unistream
from voicebot.tts.cosyvoice2.sampling import RasSampler, greedy, sample_rows

aten = torch.ops.aten
SPEECH = 64


class HostSyncs(TorchDispatchMode):
    """Counts, by name, the calls that make the host wait for the device on CUDA."""

    VALUE_SIZED = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                   aten.repeat_interleave.Tensor, aten._unique2.default, aten.unique_consecutive.default}

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.reading = 0  # inside a counted Python-level read: its own aten calls are not counted again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.reading:
            pass
        elif func in self.VALUE_SIZED:
            self.counts[str(func)] += 1
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            self.counts[f"{func} (boolean mask)"] += 1
        return func(*args, **kwargs)

    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def counting_syncs(monkeypatch):
    """A HostSyncs active, with the Python-level reads and blocking copies counted into it."""
    mode = HostSyncs()

    def counted(name, original):
        def call(*args, **kwargs):
            if not mode.reading:
                mode.counts[name] += 1
            mode.reading += 1
            try:
                return original(*args, **kwargs)
            finally:
                mode.reading -= 1
        return call

    with monkeypatch.context() as m:
        # Python-level reads: under inference_mode a CPU tensor's item() does not reach the mode.
        for method in ("tolist", "cpu", "numpy", "item", "__int__", "__float__", "__bool__", "__index__"):
            m.setattr(torch.Tensor, method, counted(f"Tensor.{method}", getattr(torch.Tensor, method)))
        for factory in ("tensor", "as_tensor"):  # with a device: a blocking host-to-device copy on CUDA
            original = getattr(torch, factory)

            def constructed(*args, _original=original, _name=factory, **kwargs):
                if kwargs.get("device") is not None:
                    mode.counts[f"torch.{_name}(..., device=)"] += 1
                return _original(*args, **kwargs)
            m.setattr(torch, factory, constructed)
        with mode:
            yield mode


@pytest.fixture(scope="module")
def lm() -> CosyVoice2LM:
    torch.set_num_threads(1)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=512)
    torch.manual_seed(2)
    return CosyVoice2LM(cfg, speech_token_size=SPEECH).eval()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded-graph-path"])
@pytest.mark.parametrize("rows", [1, 16])
def test_a_decode_step_waits_for_the_device_once_whatever_the_batch(lm, monkeypatch, rows, graphs):
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
        with counting_syncs(monkeypatch) as syncs:
            pool.decode(decoding)
        assert syncs.total() == 1 and syncs.counts["Tensor.tolist"] == 1, (len(decoding), dict(syncs.counts))
        steps += 1
    assert steps >= 10


def test_the_counter_sees_what_waits_for_the_device(monkeypatch):
    """HostSyncs counts each kind it claims to (so a step's count of 1 is not the counter's blindness)."""
    x = torch.arange(6.0)
    with torch.inference_mode(), counting_syncs(monkeypatch) as syncs:
        int(x.max()), x.tolist(), x[x > 2], x.nonzero(), torch.tensor([1, 2], device="cpu"), x[torch.tensor(2)].item()
    assert syncs.counts == {"Tensor.__int__": 1, "Tensor.tolist": 1, "aten.index.Tensor (boolean mask)": 1,
                            "aten.nonzero.default": 1, "torch.tensor(..., device=)": 1, "Tensor.item": 1}, syncs.counts


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
