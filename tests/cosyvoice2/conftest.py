"""Fixtures for the CosyVoice 2 tests.

The golden fixture directory is $VOICEBOT_CV2_FIXTURES, by default tests/data/cosyvoice2 (in the
repository; its README says what each file is and where it came from). Golden tests read every
expected value, shape and hyper-parameter from it, so another fixture set of the same format can be
swapped in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from voicebot.tts.cosyvoice2.flow import build_flow
from voicebot.tts.cosyvoice2.hift import build_hift
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, Qwen2Config
from voicebot.tts.cosyvoice2.loader import load_checkpoint
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("VOICEBOT_CV2_FIXTURES", REPO_ROOT / "tests" / "data" / "cosyvoice2"))


@pytest.fixture(scope="session")
def cv2_dir() -> Path:
    if not (FIXTURES / "golden.safetensors").is_file():
        # the set ships with the repository: a missing one is a broken checkout or a wrong variable
        pytest.fail(f"no CosyVoice 2 fixtures at {FIXTURES} (VOICEBOT_CV2_FIXTURES names another set)")
    torch.set_num_threads(1)  # the machine is shared; the fixtures hold at 1 thread too
    return FIXTURES


@pytest.fixture(scope="session")
def cv2_golden(cv2_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(cv2_dir / "golden.safetensors")


@pytest.fixture(scope="session")
def cv2_meta(cv2_dir: Path) -> dict:
    return json.loads((cv2_dir / "golden_meta.json").read_text())


@pytest.fixture(scope="session")
def cv2_manifest(cv2_dir: Path) -> dict:
    return json.loads((cv2_dir / "manifest_full.json").read_text())


@pytest.fixture(scope="module")
def t2w(cv2_dir: Path) -> Token2Wav:
    """Flow and HiFT of the fixture directory, loaded strictly; one per test module (it caches
    voices' prompt states)."""
    hp = load_hparams(cv2_dir)
    flow, hift = build_flow(hp["flow"]).eval(), build_hift(hp["hift"]).eval()
    load_checkpoint(flow, cv2_dir / "flow.pt")
    load_checkpoint(hift, cv2_dir / "hift.pt", strip="generator.")
    return Token2Wav(flow, hift)


@pytest.fixture(scope="module")
def prompt(cv2_golden: dict) -> FlowPrompt:
    return FlowPrompt(cv2_golden["flow.prompt_token"], cv2_golden["flow.prompt_feat"], cv2_golden["flow.embedding"])


@pytest.fixture
def golden_stream(cv2_golden: dict, t2w: Token2Wav, prompt: FlowPrompt):
    """The fixture's target tokens streamed through `t2w` `per_push` at a time (zero noise): its chunks."""

    def run(mode: str, per_push: int) -> list[torch.Tensor]:
        tokens = cv2_golden["flow.token"][0].tolist()
        stream = t2w.stream(prompt, zero_noise=True, mode=mode)
        chunks = []
        for i in range(0, len(tokens), per_push):
            chunks += stream.push(tokens[i : i + per_push])
        return [*chunks, stream.finish()]

    return run


@pytest.fixture(scope="module")
def lm() -> CosyVoice2LM:
    """A 2-layer random CosyVoice 2 LM of the real architecture, 64 speech tokens; seed 2 gives sampled
    replies of 13 to 51 tokens. (The golden tests' modules load the fixture checkpoint's LM instead.)"""
    torch.set_num_threads(1)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=512)
    torch.manual_seed(2)
    return CosyVoice2LM(cfg, speech_token_size=64).eval()
