"""The optional int8 LM (voicebot/tts/cosyvoice2/quant.py) on a reduced-size model at the real
dimensions (hidden 896, ffn 4864, 14/2 heads, 6561 speech tokens; 4 of the 24 layers), random weights.

Bound: relative logit error ≤ 2 % against fp32 on decode steps (24 layers measured 1.15 %); the
prefill stays fp32, so its logits are equal.
"""

from __future__ import annotations

import pytest
import torch

from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, Qwen2Config, generate
from voicebot.tts.cosyvoice2.quant import DynamicInt8Linear, decode_weight_bytes, quantize_lm
from voicebot.tts.cosyvoice2.sampling import greedy

LOGIT_REL_ERROR = 0.02


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def models() -> tuple[CosyVoice2LM, CosyVoice2LM]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                      num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                      max_position_embeddings=32768)
    fp32 = CosyVoice2LM(cfg, speech_token_size=6561).eval()
    int8 = CosyVoice2LM(cfg, speech_token_size=6561).eval()
    int8.load_state_dict(fp32.state_dict())
    return fp32, quantize_lm(int8)


def test_decode_steps_within_the_logit_bound(models: tuple[CosyVoice2LM, CosyVoice2LM]) -> None:
    fp32, int8 = models
    g = torch.Generator().manual_seed(1)
    prefix = torch.randn(1, 202, 896, generator=g)
    caches = [m.new_cache(256) for m in models]
    with torch.inference_mode():
        hidden = [m.qwen(prefix, torch.arange(202), c) for m, c in zip(models, caches)]
        assert torch.equal(hidden[0], hidden[1]), "prefill runs the fp32 weights"
        for pos in range(202, 207):
            x = fp32.speech_embedding.weight[int(torch.randint(0, 6561, (1,), generator=g))].reshape(1, 1, -1)
            a, b = (m.llm_decoder(m.qwen(x, torch.tensor([pos]), c)) for m, c in zip(models, caches))
            assert _rel(b, a) <= LOGIT_REL_ERROR


def test_int8_lm_generates_and_reads_less(models: tuple[CosyVoice2LM, CosyVoice2LM]) -> None:
    fp32, int8 = models
    assert sum(isinstance(m, DynamicInt8Linear) for m in int8.modules()) == 6 * 4
    assert decode_weight_bytes(int8) < 0.5 * decode_weight_bytes(fp32)
    tokens = list(generate(int8, int8.new_cache(256), greedy, [1, 2, 3, 4], min_token_text_ratio=2,
                           max_token_text_ratio=2))
    assert len(tokens) == 8 and all(0 <= t < 6561 for t in tokens)


def test_only_fp32_cpu_models() -> None:
    cfg = Qwen2Config(64, 32, 64, 1, 2, 1, 1e6, 1e-6, 128)
    with pytest.raises(ValueError):
        quantize_lm(CosyVoice2LM(cfg, 8).to(torch.bfloat16))
