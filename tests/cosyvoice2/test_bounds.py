"""The golden bounds (golden_bounds.py) hold on a set of other sizes and seeds than the fixtures'.

No official outputs exist for another set here, so the exact reference is our own code in float64:
its distance from our fp32 output is one fp32 implementation's own rounding error. Two fp32
implementations (ours, the official) may differ by the sum of theirs, so each must stay within
half of a bound. The models are random, drawn as the fixtures' were (README: LM weights N(0, 0.25²)
scaled to the width, norms 1 + N(0, 0.1²), biases N(0, 0.05²); flow at PyTorch's default
initialisation; HiFT's f0 classifier scaled so that frames are voiced).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from golden_bounds import HALF_LOGITS, LOGITS, MEL, SOURCE, SPEECH, max_error_to_peak
from voicebot.tts.cosyvoice2.flow import build_flow
from voicebot.tts.cosyvoice2.hift import SourceNoise, build_hift
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, Qwen2Config

pytestmark = pytest.mark.golden
DTYPES = (torch.float32, torch.float64)


@pytest.fixture(scope="module")
def other_sizes(cv2_dir: Path) -> dict:
    """The fixture set's hyper-parameters with other widths, depths and vocabulary."""
    h = copy.deepcopy(load_hparams(cv2_dir))
    flow, encoder, estimator = h["flow"], h["flow"]["encoder"], h["flow"]["decoder"]["estimator"]
    flow["input_size"] = encoder["input_size"] = encoder["output_size"] = 96
    flow["vocab_size"] = 300
    encoder.update(attention_heads=4, linear_units=256, num_blocks=3)
    estimator.update(channels=[48], num_heads=3, n_blocks=2)
    h["hift"]["base_channels"] = 48
    return h


def _flow_mels(hp: dict) -> dict:
    torch.manual_seed(777)
    flow = build_flow(hp["flow"]).eval()
    g = torch.Generator().manual_seed(99)
    tokens, prompt = (torch.randint(0, 300, (1, n), generator=g, dtype=torch.int32) for n in (90, 17))
    feat, embedding = torch.randn(1, 34, 80, generator=g) * 3 - 4, torch.randn(1, 192, generator=g)
    mels = {}
    for dtype in DTYPES:
        flow.to(dtype)
        for streaming in (False, True):
            with torch.inference_mode():
                mels[dtype, streaming] = flow.inference(tokens, prompt, feat.to(dtype), embedding.to(dtype),
                                                        streaming=streaming, finalize=True)
    return mels


def test_flow_and_hift_in_fp32_are_within_half_the_bounds_of_float64(other_sizes: dict) -> None:
    mels = _flow_mels(other_sizes)
    for streaming in (False, True):
        assert max_error_to_peak(mels[torch.float32, streaming], mels[torch.float64, streaming].float()) <= MEL / 2
    torch.manual_seed(778)
    hift = build_hift(other_sizes["hift"]).eval()
    with torch.no_grad():
        hift.f0_predictor.classifier.weight.mul_(3000)
        hift.f0_predictor.classifier.bias.fill_(120)
    mel = mels[torch.float32, False][:, :, :60]
    out = {}
    for dtype in DTYPES:
        hift.to(dtype)
        zeros = SourceNoise.zeros(mel.shape[2] * hift.samples_per_frame, hift.m_source.n_harmonics)
        with torch.inference_mode():
            out[dtype] = hift.inference(mel.to(dtype), noise=SourceNoise(zeros.rand_ini.to(dtype), zeros.sine_noise.to(dtype)))
    (speech, source), (speech64, source64) = out[torch.float32], out[torch.float64]
    assert max_error_to_peak(speech, speech64.float()) <= SPEECH / 2
    assert max_error_to_peak(source, source64.float()) <= SOURCE / 2


@pytest.mark.parametrize(("width", "ffn", "layers", "heads"), [(128, 352, 4, 8), (256, 704, 8, 8)])
def test_lm_logits_are_within_half_the_bounds_of_float64(width: int, ffn: int, layers: int, heads: int) -> None:
    cfg = Qwen2Config(vocab_size=400, hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                      max_position_embeddings=64)
    torch.manual_seed(width)
    lm = CosyVoice2LM(cfg, 100).eval()
    std = 0.25 * (64 / width) ** 0.5  # the fixtures' N(0, 0.25²) at width 64, so activations keep their scale
    with torch.no_grad():
        for name, p in lm.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else (0.05 if "bias" in name else std) * torch.randn_like(p))
    x = torch.randn(1, 60, width, generator=torch.Generator().manual_seed(1)) * 0.25
    logits = {}
    for dtype in (*DTYPES, torch.float16):  # float16 last: its weights are rounded copies
        lm.to(dtype)
        with torch.inference_mode():
            logits[dtype] = lm.llm_decoder(lm.qwen(x.to(dtype), torch.arange(60), lm.new_cache(60)))
    assert max_error_to_peak(logits[torch.float32], logits[torch.float64].float()) <= LOGITS / 2
    # float16 is bounded against fp32, whose own error is 10^3 times smaller: the whole bound applies
    assert max_error_to_peak(logits[torch.float16].float(), logits[torch.float64].float()) <= HALF_LOGITS
