"""The optional int8 LM (voicebot/tts/cosyvoice2/quant.py) on a reduced-size model at the real
dimensions (hidden 896, ffn 4864, 14/2 heads, 6561 speech tokens; 4 of the 24 layers), random weights.

Each int8 layer is compared with an exact int8 reference computed here: the same per-channel int8
weights and 7-bit per-call activation (torch's choice of scale and zero point, as fbgemm makes it),
dequantized and multiplied in float64. fbgemm sums the integer products exactly in int32, so what
is left is fp32 rounding of the scaling (6e-8 of the peak measured); a wrong scale, zero point,
range or layer shows as a quantisation step (1e-2 of the peak from fp32 at these sizes). How far
int8 is from fp32 overall depends on the weights, so it is not bounded here (quant.py gives the
figures: 1.15 % on 24 random layers).
"""

from __future__ import annotations

import pytest
import torch

from golden_bounds import LOGITS, assert_close_to_peak
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, Qwen2Config, generate
from voicebot.tts.cosyvoice2.quant import DynamicInt8Linear, decode_weight_bytes, quantize_lm
from voicebot.tts.cosyvoice2.sampling import greedy


def _int8_reference(layer: DynamicInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the layer computes for x, exactly: dequantized int8 operands multiplied in float64."""
    w = layer.fp32.weight.detach()
    w_scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    qw = torch.quantize_per_channel(w, w_scale, torch.zeros(len(w), dtype=torch.long), 0, torch.qint8)
    x_scale, x_zero = torch._choose_qparams_per_tensor(x, True)  # reduce_range: 7 bits, as the layer asks
    qx = torch.quantize_per_tensor(x, x_scale, x_zero, torch.quint8)
    bias = None if layer.fp32.bias is None else layer.fp32.bias.double()
    return torch.nn.functional.linear(qx.dequantize().double(), qw.dequantize().double(), bias).float()


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


def test_decode_steps_are_the_exact_int8_products(models: tuple[CosyVoice2LM, CosyVoice2LM]) -> None:
    fp32, int8 = models
    g = torch.Generator().manual_seed(1)
    prefix = torch.randn(1, 202, 896, generator=g)
    caches = [m.new_cache(256) for m in models]
    layers = [m for m in int8.modules() if isinstance(m, DynamicInt8Linear)]
    seen: list[tuple[DynamicInt8Linear, torch.Tensor, torch.Tensor]] = []
    hooks = [layer.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out))) for layer in layers]
    try:
        with torch.inference_mode():
            hidden = [m.qwen(prefix, torch.arange(202), c) for m, c in zip(models, caches)]
            assert torch.equal(hidden[0], hidden[1]), "prefill runs the fp32 weights"
            seen.clear()
            for pos in range(202, 205):
                x = fp32.speech_embedding.weight[int(torch.randint(0, 6561, (1,), generator=g))].reshape(1, 1, -1)
                int8.llm_decoder(int8.qwen(x, torch.tensor([pos]), caches[1]))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == 3 * len(layers)
    for i, (layer, x, out) in enumerate(seen):
        assert_close_to_peak(out, _int8_reference(layer, x), LOGITS, f"call {i}")


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
