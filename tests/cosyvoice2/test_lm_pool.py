"""The LM pool (voicebot/tts/cosyvoice2/lm_pool.py) on a tiny random-weight CosyVoice 2 LM: rows at different
lengths joining and leaving between steps, chunked prefill, the bucketed (CUDA graph) step on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from voicebot.serving.model_interfaces import PoolFull
from voicebot.tts.cosyvoice2.bistream import Bistream
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, Linear, generate, run_alone, unistream
from voicebot.tts.cosyvoice2.lm_pool import DECODE_BUCKETS, LMPool, decode_bucket
from voicebot.tts.cosyvoice2.sampling import RasSampler

SPEECH = 64



def ras(seed: int) -> RasSampler:
    return RasSampler(generator=torch.Generator().manual_seed(seed))


# (text, prompt text, prompt speech, seed): prefixes of 1 + 3 + 1 + 0, 1 + 9 + 1 + 20 and 1 + 5 + 1 + 7 positions
REQUESTS = [
    (list(range(3)), [], [], 1),
    (list(range(4, 8)), list(range(20, 29)), list(range(20)), 2),
    (list(range(10, 16)), list(range(40, 45)), list(range(30, 37)), 3),
]


def alone(lm: CosyVoice2LM, text, prompt_text, prompt_speech, seed) -> list[int]:
    return list(generate(lm, lm.new_cache(256), ras(seed), text, prompt_text, prompt_speech))


def test_rows_joining_and_leaving_decode_what_each_decodes_alone(lm: CosyVoice2LM) -> None:
    expected = [alone(lm, *r) for r in REQUESTS]
    assert all(len(e) > 5 for e in expected)
    pool = LMPool(lm, slots=3, max_seq_len=256, prefill_chunk=4)
    got: dict[int, list[int]] = {}
    rows: dict[int, object] = {}
    step = 0
    while len(got) < len(REQUESTS) or rows:
        # request i joins at step 3·i: mid-way through the others' prefills and decodes
        for i, (text, prompt_text, prompt_speech, seed) in enumerate(REQUESTS):
            if step == 3 * i:
                rows[i] = pool.open(ras(seed))
                pool.start(rows[i], unistream(lm, 256, text, prompt_text, prompt_speech))
                got[i] = []
        decoding = [row for row in rows.values() if row.waiting == 1]
        prefilling = [row for row in rows.values() if row.waiting > 1]
        if decoding:
            pool.decode(decoding)
        if prefilling:
            pool.prefill(prefilling[0])
        for i, row in list(rows.items()):
            got[i] += row.take()
            if row.step is None:  # ended: it leaves, its slot freed for whoever comes next
                pool.close(row)
                del rows[i]
        step += 1
        assert step < 2000
    assert [got[i] for i in range(len(REQUESTS))] == expected
    assert pool.free == 3


def iterate(pool: LMPool, rows: list) -> None:
    """What a scheduler iteration does: one decode step of the rows on one position, a prefill chunk for the others."""
    decoding = [row for row in rows if row.waiting == 1]
    if decoding:
        pool.decode(decoding)
    for row in rows:
        if row.waiting > 1:
            pool.prefill(row)


def test_a_row_leaving_mid_reply_changes_nothing_for_the_others(lm: CosyVoice2LM) -> None:
    expected = alone(lm, *REQUESTS[1])
    pool = LMPool(lm, slots=2, max_seq_len=256, prefill_chunk=64)
    keep, leave = pool.open(ras(REQUESTS[1][3])), pool.open(ras(REQUESTS[2][3]))
    pool.start(keep, unistream(lm, 256, *REQUESTS[1][:3]))
    pool.start(leave, unistream(lm, 256, *REQUESTS[2][:3]))
    for _ in range(4):
        iterate(pool, [keep, leave])
    assert leave.take() and keep.step is not None
    pool.close(leave)  # barge-in
    for _ in range(1000):
        if keep.step is None:
            break
        iterate(pool, [keep])
    assert keep.take() == expected and pool.free == 1


def test_chunked_prefill_matches_one_prefill(lm: CosyVoice2LM) -> None:
    """35 prefill positions: in chunks of 4 (the last chunk of 3 draws), of 17 (the last position
    left to the decode step) and at once; then one decode step."""
    text, prompt_text, prompt_speech, _ = REQUESTS[1]
    runs = []
    for chunk in (4, 17, 1000):
        logps: list[torch.Tensor] = []
        runs.append(logps)
        pool = LMPool(lm, slots=1, max_seq_len=256, prefill_chunk=chunk)
        row = pool.open(lambda logp, history, logps=logps: logps.append(logp.clone()) or int(logp[:SPEECH].argmax()))
        pool.start(row, unistream(lm, 256, text, prompt_text, prompt_speech))
        assert row.step.length == 35
        while len(logps) < 3:
            iterate(pool, [row])
    for logps in runs:
        torch.testing.assert_close(torch.stack(logps), torch.stack(runs[-1]), atol=1e-5, rtol=0)


def test_bistream_rows_in_a_batch(lm: CosyVoice2LM) -> None:
    """Two bistream requests fed text a token at a time, their steps interleaved, equal each alone."""
    def texts(seed):
        return [list(range(seed, seed + 3)), list(range(seed + 3, seed + 9)), list(range(seed + 9, seed + 11))]

    def run_one(seed):
        cache, sampler = lm.new_cache(256), ras(seed)
        stream, out = Bistream(lm, 256, [1, 2], list(range(seed, seed + 17))), []
        for ids in texts(seed):
            out += run_alone(lm, cache, sampler, stream.push(ids))
        return out + list(run_alone(lm, cache, sampler, stream.finish()))

    expected = [run_one(s) for s in (5, 11)]
    pool = LMPool(lm, slots=2, max_seq_len=256, prefill_chunk=3)
    streams = [Bistream(lm, 256, [1, 2], list(range(s, s + 17))) for s in (5, 11)]
    rows = [pool.open(ras(s)) for s in (5, 11)]
    pending = [[*(texts(s)), None] for s in (5, 11)]  # None: the end of text
    got = [[], []]
    for _ in range(5000):
        for i, row in enumerate(rows):
            if row.step is None and row.program is None and pending[i]:
                ids = pending[i].pop(0)
                pool.start(row, streams[i].push(ids) if ids is not None else streams[i].finish())
        if not any(r.step for r in rows) and not any(pending):
            break
        decoding = [r for r in rows if r.waiting == 1]
        if decoding:
            pool.decode(decoding)
        for row in rows:
            if row.waiting > 1:
                pool.prefill(row)
        for i, row in enumerate(rows):
            got[i] += row.take()
    assert got == expected and all(len(g) > 10 for g in got)


def test_padded_bucket_step_equals_the_exact_batch(lm: CosyVoice2LM) -> None:
    """The CUDA graph path's computation (the batch padded to its bucket with scratch rows, a fixed
    key count), run eagerly on CPU: the real rows get the same tokens."""
    results = []
    for graphs in (False, True):
        pool = LMPool(lm, slots=3, max_seq_len=256, graphs=graphs)
        rows = [pool.open(ras(seed)) for *_, seed in REQUESTS]
        for row, request in zip(rows, REQUESTS):
            pool.start(row, unistream(lm, 256, *request[:3]))
            while row.waiting > 1:
                pool.prefill(row)
        for _ in range(6):
            pool.decode([r for r in rows if r.step is not None])  # 3 rows: bucket 4, one scratch row
        results.append([row.take() for row in rows])
    assert results[0] == results[1] and all(results[0])


def test_decode_buckets() -> None:
    assert [decode_bucket(n) for n in (1, 2, 3, 5, 16, 17, 33, 48, 49, 64)] == [1, 2, 4, 8, 16, 32, 48, 48, 64, 64]
    with pytest.raises(ValueError):
        decode_bucket(65)
    with pytest.raises(ValueError):
        decode_bucket(0)
    assert DECODE_BUCKETS[-1] == 64


def test_a_full_pool_refuses_and_a_closed_slot_is_reused(lm: CosyVoice2LM) -> None:
    pool = LMPool(lm, slots=1, max_seq_len=64)
    row = pool.open(ras(0))
    with pytest.raises(PoolFull):
        pool.open(ras(1))
    pool.close(row)
    pool.close(row)  # twice is once
    assert pool.open(ras(1)).slot == row.slot and pool.free == 0


def test_prepacked_weights_serve_many_rows_and_follow_the_weights(lm: CosyVoice2LM) -> None:
    """A pool prepacks the LM's linear layers; calls on many rows use the copy, one row the dense
    weight, both giving F.linear's values; a written weight is repacked, and the state dict is unchanged."""
    LMPool(lm, slots=2, max_seq_len=64)
    linear = lm.qwen.layers[0].mlp.gate_proj
    assert isinstance(linear, Linear) and linear.packed_nbytes() == linear.weight.numel() * 4
    assert lm.prepack() == sum(m.weight.numel() * 4 for m in lm.modules() if isinstance(m, Linear))
    assert set(lm.state_dict()) == set(CosyVoice2LM(lm.cfg, speech_token_size=SPEECH).state_dict())
    x = torch.randn(5, 3, linear.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight), atol=1e-5, rtol=1e-5)
        assert torch.equal(linear(x[:1, :1]), F.linear(x[:1, :1], linear.weight))  # one row: the dense GEMV
    before = linear.weight.detach().clone()
    try:
        with torch.no_grad():
            linear.weight.mul_(2)  # a write (as a load would): the copy follows it
        with torch.inference_mode():
            torch.testing.assert_close(linear(x), F.linear(x, linear.weight), atol=1e-5, rtol=1e-5)
    finally:
        with torch.no_grad():
            linear.weight.copy_(before)
