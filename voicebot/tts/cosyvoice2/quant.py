"""Optional int8 LM: dynamic quantization of the Qwen2 decoder's linear layers for decode steps (CPU).

A decode step reads every decoder weight once for a single token, so on CPU it is bound by memory
traffic: 358 M fp32 weights are 1.43 GB per token. Stored as int8 (per-output-channel symmetric
scales) they are a quarter of that, and the x86 (fbgemm) kernel multiplies them against the
activation quantized to 7-bit on the fly ("dynamic": a fresh scale per call, no calibration).
Measured on one core of this machine (CPU time, 4864×896, 40 distinct matrices so nothing stays in
cache): fp32 1.40 ms, this 0.42 ms; torch's weight-only int8 kernel (`_weight_int8pack_mm`) took
6.4 ms and bf16 weights 1.09 ms, which is why dynamic int8 is the one used.

What stays fp32, and why (relative logit error against fp32, 24 layers at the real dimensions,
random weights, one decode step after a 202-token prefix):
- prefill: one activation scale for all 202 tokens made the error 4.7 %; prefill is bound by
  compute rather than weight reads, so it keeps the fp32 weights (+0.1 GB of int8 beside them);
- `down_proj`: its input, silu(gate)·up, is heavy-tailed; quantizing it too gave 2.2 % per step,
  leaving it fp32 gives 1.15 % (measured once; tests/cosyvoice2/test_int8.py checks each int8
  layer against an exact int8 reference instead of a bound on this figure);
- the speech head (`llm_decoder`) and the embeddings.
How often a trained model's sampled tokens change cannot be measured without the real weights.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from voicebot.tts.cosyvoice2.lm import CosyVoice2LM


class DynamicInt8Linear(nn.Module):
    """nn.Linear with int8 weights (per output channel) and activations quantized per call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float().cpu()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        zero = torch.zeros(self.out_features, dtype=torch.long)
        qweight = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self._nbytes = qweight.numel() + scale.numel() * 4 + (0 if bias is None else bias.numel() * 4)
        self.fp32 = linear  # prefill: many tokens share one activation scale, and compute, not weight reads, bounds it

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-2] > 1:
            return self.fp32(x)
        # reduce_range: 7-bit activations, so fbgemm's u8×s8 pair sums cannot saturate int16 on AVX2
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)

    def nbytes(self) -> int:
        return self._nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic"


KEEP_FP32 = frozenset({"down_proj"})


def quantize_lm(lm: CosyVoice2LM, keep_fp32: frozenset[str] = KEEP_FP32) -> CosyVoice2LM:
    """Wrap the Qwen2 blocks' linear layers, except those named in keep_fp32, in place (CPU, fp32
    model only). The fp32 weights stay in the wrappers (prefill uses them), so the state dict and
    strict checkpoint loading are unchanged only for the modules not wrapped: quantize after loading.
    """
    if lm.llm_decoder.weight.device.type != "cpu" or lm.llm_decoder.weight.dtype != torch.float32:
        raise ValueError("int8 dynamic quantization is for the fp32 model on CPU")
    for block in lm.qwen.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and name not in keep_fp32:
                    setattr(parent, name, DynamicInt8Linear(child))
    return lm


def decode_weight_bytes(lm: CosyVoice2LM) -> int:
    """Bytes of weights one decode step reads in the decoder blocks (the memory-bound part)."""
    total = 0
    for block in lm.qwen.layers:
        for module in (*block.self_attn.children(), *block.mlp.children()):
            if isinstance(module, DynamicInt8Linear):
                total += module.nbytes()
            elif isinstance(module, nn.Linear):
                total += sum(p.numel() * p.element_size() for p in module.parameters())
    return total
