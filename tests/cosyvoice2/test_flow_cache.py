"""The cached streaming flow (estimator keys/values and conv context per Euler step) against the
official recompute-everything algorithm, on the fixture weights with longer random token streams.

Every non-final chunk must equal the frames that a full recompute of the prefix gives for it
(max abs error reached: 3e-6 on mels of magnitude ~5, 6e-7 of the peak), for prompts that are and are not multiples
of the chunk size and for several hop schedules; the cached final chunk must equal the official
`streaming=True, finalize=True` output.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from golden_bounds import MEL, SPEECH, assert_close_to_peak
from voicebot.tts.cosyvoice2.flow import Flow, FlowCache, build_flow
from voicebot.tts.cosyvoice2.hift import build_hift
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.loader import load_checkpoint
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, StreamSchedule, Token2Wav

pytestmark = pytest.mark.golden

@pytest.fixture(scope="module")
def flow(cv2_dir: Path) -> Flow:
    model = build_flow(load_hparams(cv2_dir)["flow"]).eval()
    load_checkpoint(model, cv2_dir / "flow.pt")
    return model


def _inputs(flow: Flow, n_prompt: int, n_tokens: int, seed: int) -> tuple[FlowPrompt, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vocab = flow.input_embedding.num_embeddings
    prompt = FlowPrompt(torch.randint(0, vocab, (1, n_prompt), generator=g, dtype=torch.int32),
                        torch.randn(1, 2 * n_prompt, 80, generator=g) * 2 - 5, torch.randn(1, 192, generator=g))
    return prompt, torch.randint(0, vocab, (1, n_tokens), generator=g, dtype=torch.int32)


def _boundaries(n_prompt: int, n_tokens: int, hops: list[int], chunk: int, lookahead: int) -> list[int]:
    """Token counts at which the stream renders non-final chunks: the first hop padded to a chunk boundary."""
    ends, end = [], math.ceil(n_prompt / chunk) * chunk - n_prompt
    for hop in hops:
        end += hop
        if end + lookahead > n_tokens:
            break
        ends.append(end)
    return ends


def _buffer_frames(cache: FlowCache) -> set[int]:
    """The frame capacities of a cache's key/value buffers."""
    return {t.shape[2] for step in cache.steps for t in (*step.keys, *step.values) if t is not None}


@pytest.mark.parametrize("n_prompt", [0, 25, 37, 78])
@pytest.mark.parametrize("hops", [[25, 50, 100, 100, 100], [25] * 12, [50, 75, 25, 150]])
def test_cached_chunks_equal_the_recompute(flow: Flow, n_prompt: int, hops: list[int]) -> None:
    n_tokens = 260
    prompt, tokens = _inputs(flow, n_prompt, n_tokens, seed=n_prompt)
    args = (prompt.token, prompt.feat, prompt.embedding)
    state = flow.prompt_cache(*args)
    cached_frames = state.n_frames
    cache = state.fork()
    shared = [t.data_ptr() for step in state.steps for t in step.tensors()]
    lookahead, ratio = flow.pre_lookahead_len, flow.token_mel_ratio
    offset = 0
    for end in _boundaries(n_prompt, n_tokens, hops, flow.encoder.chunk_size, lookahead):
        mel = flow.inference(tokens[:, : end + lookahead], *args, streaming=True, finalize=False, cache=cache)
        full = flow.inference(tokens[:, : end + lookahead], *args, streaming=True, finalize=False)
        assert_close_to_peak(mel, full[:, :, offset * ratio :], MEL)
        # grown chunk by chunk after the shared prompt frames, nothing held unused
        assert _buffer_frames(cache) == {cache.n_frames - cached_frames}
        offset = end
    last = flow.inference(tokens, *args, streaming=True, finalize=True, cache=cache)
    full = flow.inference(tokens, *args, streaming=True, finalize=True)
    assert_close_to_peak(last, full[:, :, offset * ratio :], MEL)
    assert _buffer_frames(cache) == {cache.n_frames - cached_frames}
    assert state.n_frames == cached_frames, "a request wrote into the voice's prompt state"
    # the request read the voice's buffers in place: neither copied nor counted as its own
    assert [t.data_ptr() for step in state.steps for t in step.tensors()] == shared
    own = {t.data_ptr() for step in cache.steps for t in step.tensors()}
    assert not own & set(shared)


def test_prompt_state_covers_the_complete_prompt_chunks_out_of_reach_of_the_lookahead(flow: Flow) -> None:
    chunk_frames = flow.encoder.chunk_size * flow.token_mel_ratio
    for n_prompt, frames in [(0, 0), (27, 0), (28, chunk_frames), (52, chunk_frames), (53, 2 * chunk_frames)]:
        prompt, _ = _inputs(flow, n_prompt, 0, seed=1)
        assert flow.prompt_cache(prompt.token, prompt.feat, prompt.embedding).n_frames == frames


def test_cached_call_must_end_on_a_chunk_boundary(flow: Flow) -> None:
    prompt, tokens = _inputs(flow, 25, 60, seed=2)
    cache = flow.new_cache()
    with pytest.raises(ValueError, match="chunk boundary"):
        flow.inference(tokens[:, :30], prompt.token, prompt.feat, prompt.embedding, True, False, cache)


@pytest.mark.parametrize("n_prompt", [12, 50, 61, 75])
@pytest.mark.parametrize("schedule", [StreamSchedule(), StreamSchedule(hop_tokens=50, hop_growth=1)])
def test_exact_stream_equals_the_recompute_stream(cv2_dir: Path, flow: Flow, n_prompt: int,
                                                  schedule: StreamSchedule) -> None:
    """Tokens arrive one at a time."""
    hift = build_hift(load_hparams(cv2_dir)["hift"]).eval()
    load_checkpoint(hift, cv2_dir / "hift.pt", strip="generator.")
    t2w = Token2Wav(flow, hift, schedule)
    prompt, tokens = _inputs(flow, n_prompt, 230, seed=7)
    chunks: dict[str, list[torch.Tensor]] = {}
    for mode in ("recompute", "exact"):
        stream = t2w.stream(prompt, zero_noise=True, mode=mode)
        chunks[mode] = []
        for token in tokens[0].tolist():
            chunks[mode] += stream.push([token])
        chunks[mode].append(stream.finish())
    assert len(chunks["exact"]) >= 4
    for exact, official in zip(chunks["exact"], chunks["recompute"], strict=True):
        assert_close_to_peak(exact, official, SPEECH)
