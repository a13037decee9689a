"""The estimator's blocks against their plain definitions, with every parameter random.

The fixture checkpoint's biases are all zero, so the golden suite cannot see a bias added in the
wrong place; these tests give every weight and bias a value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from voicebot.tts.cosyvoice2.estimator import CausalResnetBlock1D, PackedCall, RequestRows, TransformerBlock


def randomized(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module.eval()


def packed(x: torch.Tensor) -> torch.Tensor:  # (2, C, T) -> (2T, C): conditioned rows, then unconditioned
    return x.transpose(1, 2).reshape(-1, x.shape[1])


def test_transformer_block_is_pre_norm_attention_then_feed_forward() -> None:
    block = randomized(TransformerBlock(16, heads=2, head_dim=8))
    n = 7
    x = torch.randn(2 * n, 16)
    with torch.inference_mode():
        out = block(x.clone(), PackedCall([RequestRows(n, streaming=False)], 0, x))
        attn = block.attn1
        q, k, v = (proj(block.norm1(x)).view(2, n, 2, 8).transpose(1, 2) for proj in (attn.to_q, attn.to_k, attn.to_v))
        h = x + attn.to_out[0](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2 * n, 16))
        ff = block.ff.net
        expected = h + ff[2](F.gelu(ff[0].proj(block.norm3(h))))
    torch.testing.assert_close(out, expected)


def test_causal_resnet_block_is_two_causal_conv_blocks_plus_time_and_residual() -> None:
    block = randomized(CausalResnetBlock1D(6, 10, time_emb_dim=12))
    n = 9
    x, temb = torch.randn(2, 6, n), torch.randn(1, 12)

    def conv_block(b, h: torch.Tensor) -> torch.Tensor:  # (2, C, T): causal conv k=3, LayerNorm over C, Mish
        conv, _, norm, _, act = b.block
        y = F.conv1d(F.pad(h, (2, 0)), conv.weight, conv.bias)
        return act(norm(y.transpose(1, 2)).transpose(1, 2))

    with torch.inference_mode():
        out = block(packed(x), temb, PackedCall([RequestRows(n, streaming=False)], 0, x))
        h = conv_block(block.block1, x) + block.mlp(temb)[:, :, None]
        expected = conv_block(block.block2, h) + block.res_conv(x)
    torch.testing.assert_close(out, packed(expected))
