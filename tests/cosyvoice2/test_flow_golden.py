"""Flow (tokens → mel) against the official outputs in golden.safetensors.

Max abs errors reached (fp32, 1 thread, tiny fixtures): encoder_out 8.3e-7, mel nonstream 2.0e-6,
stream_finalize 2.6e-6, first streaming chunk 2.6e-6; rand_noise bit-exact.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from golden_bounds import MEL, assert_close_to_peak
from voicebot.tts.cosyvoice2.flow import Flow, build_flow
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.loader import load_checkpoint

pytestmark = pytest.mark.golden


@pytest.fixture(scope="module")
def flow(cv2_dir: Path) -> Flow:
    model = build_flow(load_hparams(cv2_dir)["flow"]).eval()
    load_checkpoint(model, cv2_dir / "flow.pt")
    return model


@pytest.fixture(scope="module")
def inputs(cv2_golden: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: cv2_golden[f"flow.{name}"] for name in ("token", "prompt_token", "prompt_feat", "embedding")}


def test_rand_noise_is_the_official_buffer(cv2_dir: Path, cv2_golden: dict, cv2_meta: dict, flow: Flow) -> None:
    assert cv2_meta["flow.rand_noise_equals_manual_seed0_randn"]
    expected = load_file(cv2_dir / "flow_rand_noise.safetensors")["rand_noise"]
    assert torch.equal(flow.decoder.rand_noise, expected)
    first = cv2_golden["flow.rand_noise_first_frames"]
    assert torch.equal(flow.decoder.rand_noise[:, :, : first.shape[2]], first)


def test_encoder_out_nonstream(cv2_golden: dict, inputs: dict, flow: Flow) -> None:
    tokens = torch.cat([inputs["prompt_token"], inputs["token"]], dim=1)
    with torch.inference_mode():
        out = flow.encode(tokens, finalize=True, streaming=False)
    assert_close_to_peak(out, cv2_golden["flow.encoder_out.nonstream"], MEL)


@pytest.mark.parametrize(("key", "streaming"), [("flow.mel.nonstream", False), ("flow.mel.stream_finalize", True)])
def test_mel_final(cv2_golden: dict, inputs: dict, flow: Flow, key: str, streaming: bool) -> None:
    mel = flow.inference(**inputs, streaming=streaming, finalize=True)
    assert_close_to_peak(mel, cv2_golden[key], MEL)


def test_mel_stream_chunk_with_lookahead(cv2_golden: dict, inputs: dict, flow: Flow) -> None:
    # the key names the token count of the non-final streaming call, e.g. flow.mel.stream_chunk_41tok
    (key,) = [k for k in cv2_golden if k.startswith("flow.mel.stream_chunk_")]
    n_tokens = int(re.fullmatch(r"flow\.mel\.stream_chunk_(\d+)tok", key).group(1))
    mel = flow.inference(**{**inputs, "token": inputs["token"][:, :n_tokens]}, streaming=True, finalize=False)
    assert mel.shape[2] == (n_tokens - flow.pre_lookahead_len) * flow.token_mel_ratio
    assert_close_to_peak(mel, cv2_golden[key], MEL)
