"""Streamed `fast` audio equals one HiFT call over the whole chunk-causal mel (HiFTStream).

The official streaming vocoder (modes "exact"/"recompute") leaves seams: on these fixtures it is
off by up to 0.024 against a 0.075 peak. HiFTStream holds back HiFT's receptive field and carries
the sine phase, so what is left is float rounding: max abs 1.5e-5 overall, 9e-6 in the last 100 ms
and 1e-5 around seams (tiny fixture weights, fp32, 1 thread), 2e-4 of the peak. The bound is the
golden tests' speech bound (golden_bounds.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from golden_bounds import SPEECH, assert_close_to_peak
from voicebot.tts.cosyvoice2.hift import HiFT, HiFTStream, SourceNoise, build_hift
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.loader import load_checkpoint
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav



@pytest.fixture(scope="module")
def whole(cv2_golden: dict, t2w: Token2Wav, prompt: FlowPrompt) -> torch.Tensor:
    """HiFT in one call over the whole utterance's chunk-causal mel (what `fast` streams)."""
    with torch.inference_mode():
        mel = t2w.flow.inference(cv2_golden["flow.token"], prompt.token, prompt.feat, prompt.embedding,
                                 streaming=True, finalize=True)
        noise = SourceNoise.zeros(mel.shape[2] * t2w.hift.samples_per_frame, t2w.hift.m_source.n_harmonics)
        return t2w.hift.inference(mel, noise=noise)[0]


@pytest.mark.parametrize("tokens_per_push", [1, 7, 25])
def test_fast_stream_equals_whole_utterance_hift(golden_stream, whole: torch.Tensor, tokens_per_push: int) -> None:
    chunks = golden_stream("fast", tokens_per_push)
    streamed = torch.cat(chunks, dim=1)

    seams = torch.tensor([c.shape[1] for c in chunks]).cumsum(0)[:-1].tolist()
    assert len(seams) >= 2
    # one bound for every sample, seams and the final chunk included (the official stream's seams
    # are off by 0.3 of the peak, 100× this bound)
    worst = int((streamed - whole).abs().argmax()) if streamed.shape == whole.shape else None
    assert_close_to_peak(streamed, whole, SPEECH, f"worst at sample {worst}, seams at {seams}")


def _fixture_hift(cv2_dir: Path) -> HiFT:
    hift = build_hift(load_hparams(cv2_dir)["hift"]).eval()
    load_checkpoint(hift, cv2_dir / "hift.pt", strip="generator.")
    return hift


def test_hift_stream_carries_source_noise(cv2_dir: Path, cv2_golden: dict) -> None:
    """With noise on, the stream draws each sample's noise once (rand_ini first, then the samples in
    order), so it equals a whole call given the same draws; pieces of 1 and 3 frames included."""
    hift = _fixture_hift(cv2_dir)
    mel = cv2_golden["hift.mel"]
    n_samples, h = mel.shape[2] * hift.samples_per_frame, hift.m_source.n_harmonics
    gen = torch.Generator().manual_seed(7)
    noise = SourceNoise(torch.rand(1, h, generator=gen), torch.randn(1, n_samples, h, generator=gen))
    expected, _ = hift.inference(mel, noise=noise)

    stream = HiFTStream(hift, generator=torch.Generator().manual_seed(7))
    bounds = [0, 1, 4, 30, mel.shape[2]]
    pieces = [stream.push(mel[:, :, a:b], final=b == bounds[-1]) for a, b in zip(bounds, bounds[1:])]
    assert_close_to_peak(torch.cat(pieces, dim=1), expected, SPEECH)


def test_context_frames_cover_the_receptive_field(cv2_dir: Path) -> None:
    """A change to one mel frame moves no sample beyond the computed reach (to the left: the sine
    phase carries it to the right for good, which HiFTStream handles by carrying the phase)."""
    hift = _fixture_hift(cv2_dir)
    context, f0_context = hift.context_frames()
    torch.manual_seed(0)
    mel, frame, spf = torch.randn(1, 80, 80), 60, hift.samples_per_frame
    noise = SourceNoise.zeros(mel.shape[2] * spf, hift.m_source.n_harmonics)
    bumped = mel.clone()
    bumped[:, :, frame] += 1
    with torch.inference_mode():
        changed = (hift.inference(bumped, noise=noise)[0] != hift.inference(mel, noise=noise)[0]).nonzero()[:, 1]
        source, _ = hift.source(hift.f0_predictor(mel), noise)
        decoded_changed = (hift.decode(bumped, source) != hift.decode(mel, source)).nonzero()[:, 1]
    assert changed.min() >= (frame - context - f0_context) * spf
    assert decoded_changed.min() >= (frame - context) * spf
    assert decoded_changed.max() < (frame + 1 + context) * spf
