"""LM decoding on a background thread beside flow + HiFT (bench/overlap.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from bench.overlap import overlapped
from golden_bounds import SPEECH, assert_close_to_peak
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav

pytestmark = pytest.mark.golden


def _slow(tokens: list[int], delay: float = 0.002) -> Iterator[int]:
    for token in tokens:
        time.sleep(delay)  # an LM's pace: chunks render while tokens keep arriving
        yield token


def test_overlapped_chunks_equal_the_sequential_ones(cv2_golden: dict, t2w: Token2Wav, prompt: FlowPrompt) -> None:
    tokens = cv2_golden["flow.token"][0].tolist()
    stream = t2w.stream(prompt, zero_noise=True, mode="fast")
    expected = stream.push(tokens) + [stream.finish()]
    threads = torch.get_num_threads()
    chunks = list(overlapped(_slow(tokens), t2w.stream(prompt, zero_noise=True, mode="fast")))
    assert torch.get_num_threads() == threads
    assert len(chunks) == len(expected)
    for chunk, want in zip(chunks, expected):
        assert_close_to_peak(chunk, want, SPEECH)


def test_decoding_errors_reach_the_consumer(t2w: Token2Wav, prompt: FlowPrompt) -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise RuntimeError("lm failed")

    with pytest.raises(RuntimeError, match="lm failed"):
        list(overlapped(failing(), t2w.stream(prompt, zero_noise=True, mode="fast")))


def test_closing_early_stops_the_decoder(cv2_golden: dict, t2w: Token2Wav, prompt: FlowPrompt) -> None:
    consumed = []

    def tokens() -> Iterator[int]:
        for token in _slow(cv2_golden["flow.token"][0].tolist() * 10):
            consumed.append(token)
            yield token

    chunks = overlapped(tokens(), t2w.stream(prompt, zero_noise=True, mode="fast"))
    next(chunks)
    chunks.close()
    n = len(consumed)
    time.sleep(0.05)
    assert len(consumed) == n < 1200
