"""The flow's bounded left context (`flow_left_chunks`, the official `num_decoding_left_chunks`).

With a window of n chunks a streaming query sees its own 50-frame chunk and the n before it; the
cached stream keeps only what a later query can see. Checked here: the mask is the official rule,
the windowed cache gives exactly what a windowed recompute of the whole prefix gives (so dropping
frames lost nothing the window allows), what a stream holds stops growing, and a window wider than
the utterance is the unbounded flow. How far a window moves the mel from the unbounded one is a
property of the weights, not a correctness bound: bench/gpu_proxy.py --only window prints it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from golden_bounds import MEL, assert_close_to_peak
from test_flow_cache import _boundaries, _inputs
from voicebot.tts.cosyvoice2.estimator import chunk_mask
from voicebot.tts.cosyvoice2.flow import Flow, FlowCache, build_flow
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.loader import load_checkpoint

pytestmark = pytest.mark.golden


@pytest.fixture(scope="module")
def flow(cv2_dir: Path) -> Flow:
    model = build_flow(load_hparams(cv2_dir)["flow"]).eval()
    load_checkpoint(model, cv2_dir / "flow.pt")
    return model


def _official_mask(size: int, chunk: int, left: int) -> torch.Tensor:
    """The rule of the official subsequent_chunk_mask, row by row: keys from (own chunk − left)
    chunks back (0 if left < 0) up to the end of the query's own chunk."""
    mask = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        first = 0 if left < 0 else max(0, (i // chunk - left) * chunk)
        mask[i, first : min((i // chunk + 1) * chunk, size)] = True
    return mask


@pytest.mark.parametrize("left", [-1, 0, 1, 3])
def test_mask_is_the_official_rule(left: int) -> None:
    full = _official_mask(23, 4, left)
    assert torch.equal(chunk_mask(23, 4, torch.device("cpu"), left_chunks=left), full)
    # a cached call's rows, and the columns a windowed cache still holds
    assert torch.equal(chunk_mask(23, 4, torch.device("cpu"), 8, left, key_start=4), full[8:, 4:])


def _held_frames(cache: FlowCache) -> set[int]:
    return {t.shape[2] for step in cache.steps for t in (*step.keys, *step.values) if t is not None}


@pytest.mark.parametrize("left", [0, 1, 2])
@pytest.mark.parametrize("n_prompt", [0, 37, 78])
def test_windowed_cache_equals_the_windowed_recompute(flow: Flow, left: int, n_prompt: int) -> None:
    n_tokens = 260
    prompt, tokens = _inputs(flow, n_prompt, n_tokens, seed=n_prompt + left)
    args = (prompt.token, prompt.feat, prompt.embedding)
    cache = flow.prompt_cache(*args, left_chunks=left).fork()
    chunk_frames = flow.decoder.estimator.static_chunk_size
    lookahead, ratio = flow.pre_lookahead_len, flow.token_mel_ratio
    offset = 0
    for end in _boundaries(n_prompt, n_tokens, [25, 50, 100, 100], flow.encoder.chunk_size, lookahead):
        mel = flow.inference(tokens[:, : end + lookahead], *args, True, False, cache, left_chunks=left)
        full = flow.inference(tokens[:, : end + lookahead], *args, True, False, left_chunks=left)
        assert_close_to_peak(mel, full[:, :, offset * ratio :], MEL)
        # only what the next chunk's queries may see: at most the window
        assert max(_held_frames(cache) | {0}) <= left * chunk_frames
        offset = end
    last = flow.inference(tokens, *args, True, True, cache, left_chunks=left)
    full = flow.inference(tokens, *args, True, True, left_chunks=left)
    assert_close_to_peak(last, full[:, :, offset * ratio :], MEL)


def test_window_wider_than_the_utterance_is_the_unbounded_flow(flow: Flow) -> None:
    prompt, tokens = _inputs(flow, 37, 160, seed=3)
    args = (prompt.token, prompt.feat, prompt.embedding)
    wide, unbounded = (flow.inference(tokens, *args, True, True, left_chunks=n) for n in (20, -1))
    assert torch.equal(wide, unbounded)
    narrow = flow.inference(tokens, *args, True, True, left_chunks=1)
    assert not torch.allclose(narrow, unbounded)  # the window is applied at all


def test_a_streams_held_bytes_stop_growing(flow: Flow) -> None:
    prompt, tokens = _inputs(flow, 37, 500, seed=4)
    args = (prompt.token, prompt.feat, prompt.embedding)
    held = {}
    for left in (-1, 2):
        cache = flow.prompt_cache(*args, left_chunks=left).fork()
        held[left] = []
        for end in _boundaries(37, 500, [25, 50, 100, 100, 100, 100], flow.encoder.chunk_size, 3):
            flow.inference(tokens[:, : end + 3], *args, True, False, cache, left_chunks=left)
            held[left].append(cache.nbytes())
    assert held[-1][-1] > 2 * held[-1][2]  # unbounded: grows with the reply
    assert len(set(held[2][2:])) == 1  # windowed: flat once the window is full
    assert held[2][-1] < held[-1][-1] / 3


def test_a_cache_and_its_request_must_agree_on_the_window(flow: Flow) -> None:
    prompt, tokens = _inputs(flow, 25, 60, seed=5)
    cache = flow.new_cache(left_chunks=1)
    with pytest.raises(ValueError, match="window"):
        flow.inference(tokens[:, :28], prompt.token, prompt.feat, prompt.embedding, True, False, cache)
