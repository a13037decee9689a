"""Our streaming Paraformer (voicebot/asr/sanm) against funasr 1.4.16's own output.

tests/data/paraformer/golden.pt was made by funasr itself (make_fixtures.py there) from the micro
random-weight model next to it; here that model directory goes through our loader and every case
is fed exactly as funasr was fed: each decode step's encoder output and CIF weights within 1e-4,
the fired token embeddings and carried CIF state within 1e-4, the tokens equal, each call's text equal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from voicebot.asr.sanm.loader import load_paraformer
from voicebot.asr.sanm.model import ChunkConfig
from voicebot.asr.sanm.stream import StreamingParaformer

DATA = Path(__file__).resolve().parents[1] / "data" / "paraformer"
GOLDEN = torch.load(DATA / "golden.pt", weights_only=True)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def loaded():
    return load_paraformer(DATA / "model")


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert tuple(ours.shape) == tuple(theirs.shape), f"{what}: shape {tuple(ours.shape)} != funasr's {tuple(theirs.shape)}"
    if ours.numel():
        diff = (ours.float() - theirs.float()).abs().max().item()
        assert diff <= TOLERANCE, f"{what}: differs from funasr by {diff:.2e}"


def test_the_fixtures_were_made_by_funasr_1_4_16():
    assert GOLDEN["funasr_version"] == "1.4.16"
    assert len(GOLDEN["cases"]) >= 16


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["name"] for c in GOLDEN["cases"]])
def test_streaming_matches_funasr(loaded, case):
    chunk = ChunkConfig(tuple(case["chunk_size"]), case["encoder_look_back"], case["decoder_look_back"])
    engine = StreamingParaformer(loaded, chunk)
    stream = engine.open()
    audio = GOLDEN["audio"][case["audio"]].numpy().astype(np.float32) / 32768
    fed, utterance = 0, 0
    for n, call in enumerate(case["calls"]):
        if call["utterance"] != utterance:
            fed, utterance = 0, call["utterance"]
        result = engine.feed(stream, audio[fed: fed + call["samples"]], call["final"])
        fed += call["samples"]
        where = f"call {n}"
        assert len(result.steps) == len(call["steps"]), f"{where}: {len(result.steps)} decode steps, funasr {len(call['steps'])}"
        for s, (ours, theirs) in enumerate(zip(result.steps, call["steps"])):
            _close(ours.encoder_out, theirs["encoder_out"], f"{where} step {s} encoder output")
            _close(ours.alphas, theirs["alphas"], f"{where} step {s} CIF weights")
            _close(ours.fired, theirs["fired"], f"{where} step {s} CIF token embeddings")
            assert ours.token_ids == theirs["token_ids"], f"{where} step {s}: tokens differ"
            _close(torch.tensor(ours.token_logprobs), torch.tensor(theirs["token_logprobs"]), f"{where} step {s} logp")
        assert result.text == call["text"], f"{where}: text {result.text!r}, funasr {call['text']!r}"
    assert stream.state.encoder_kv is None and stream.samples.size == 0  # every case ends with a flush
