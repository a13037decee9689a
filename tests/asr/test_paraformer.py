"""The streaming recognizer on a tiny random-weight Paraformer: structure, not text."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
import yaml

from tests.asr.tiny_models import synthetic_speech
from voicebot.asr.funasr_model import CheckpointMismatch, FunasrModel
from voicebot.asr.paraformer import ParaformerRecognizer
from voicebot.config.engines import ParaformerConfig
from voicebot.models import ModelNotAvailable


async def stream_utterance(stream, audio: np.ndarray, piece: int) -> tuple[list[str], object]:
    partials = []
    for start in range(0, len(audio), piece):
        partial = await stream.accept(audio[start : start + piece])
        if partial is not None:
            partials.append(partial)
    return partials, await stream.finish()


def test_streamed_deltas_make_the_one_shot_result(recognizer):
    audio = synthetic_speech(5.0, seed=3)
    partials, final = asyncio.run(stream_utterance(recognizer.open(), audio, piece=3000))
    one_shot = recognizer.streaming.decode_blocking(audio)

    assert final.text == one_shot.text != ""
    assert len(partials) >= 3
    # Partials are cumulative: each extends the previous one, and the final extends the last.
    for earlier, later in zip(partials, partials[1:] + [final.text]):
        assert later.startswith(earlier) and len(later) > len(earlier) or later == earlier


def test_one_confidence_per_emitted_character(recognizer):
    audio = synthetic_speech(4.0, seed=4)
    _, final = asyncio.run(stream_utterance(recognizer.open(), audio, piece=9600))
    assert final.token_count == len(final.text) > 0
    assert 0 < final.min_token_confidence <= final.confidence <= 1
    assert final.model == "asr.paraformer.model"


def test_offline_confidences_match_characters(tiny_models):
    model = FunasrModel("offline", tiny_models["offline"])
    model.load()
    decoded = model.decode_blocking(synthetic_speech(4.0, seed=5))
    model.close()
    assert len(decoded.token_confidences) == len(decoded.text) > 0


def test_finish_resets_the_stream(recognizer):
    audio = synthetic_speech(3.0, seed=6)

    async def two_utterances():
        stream = recognizer.open()
        _, first = await stream_utterance(stream, audio, piece=4800)
        assert stream.state_bytes() < 1024  # the cache and the kept audio are gone
        _, second = await stream_utterance(stream, audio, piece=4800)
        return first, second

    first, second = asyncio.run(two_utterances())
    # Nothing from the first utterance leaks into the second.
    assert first.text == second.text and first.confidence == second.confidence


def test_reset_reports_generation_and_bytes(recognizer):
    async def run():
        stream = recognizer.open()
        await stream.accept(synthetic_speech(1.5, seed=7))
        held = stream.state_bytes()
        report = await stream.reset()
        return held, report, stream.state_bytes()

    held, report, after = asyncio.run(run())
    assert report.generation == 1 and report.bytes_freed == held > 10_000 and after < 1024


def test_concurrent_sessions_match_sequential(recognizer):
    clips = [synthetic_speech(3.0, seed=10 + i) for i in range(4)]

    async def one(clip):
        return await stream_utterance(recognizer.open(), clip, piece=2400)

    async def sequential():
        return [await one(clip) for clip in clips]

    async def concurrent():
        return await asyncio.gather(*(one(clip) for clip in clips))

    alone, together = asyncio.run(sequential()), asyncio.run(concurrent())
    assert [(p, f.text, f.confidence) for p, f in alone] == [(p, f.text, f.confidence) for p, f in together]
    assert len({f.text for _, f in alone}) == 4  # different audio, different text: the check has teeth


def test_wrong_checkpoint_is_refused(tiny_models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["streaming"], broken)
    config = yaml.safe_load((broken / "config.yaml").read_text(encoding="utf-8"))
    config["encoder_conf"]["num_blocks"] += 1
    (broken / "config.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    with pytest.raises(CheckpointMismatch, match="missing"):
        FunasrModel("broken", broken).load()


def test_missing_model_names_the_key_and_the_id(tmp_path):
    config = ParaformerConfig(model_cache=tmp_path)  # the default id, never downloaded here
    with pytest.raises(ModelNotAvailable) as error:
        ParaformerRecognizer(config).load()
    message = str(error.value)
    assert "asr.paraformer.model" in message and config.model in message and "voicebot.models fetch" in message


def test_positional_encoding_patch_is_exact(recognizer):
    import torch
    from funasr.models.transformer.embedding import StreamSinusoidalPositionEncoder

    encoder = StreamSinusoidalPositionEncoder()
    x = torch.randn(1, 15, 64)
    start = 36000  # an hour into an unflushed stream
    patched = encoder(x, {"start_idx": start})
    positions = torch.arange(1, start + 16)[None, :]
    reference = x + encoder.encode(positions, 64, x.dtype)[:, start:]
    assert torch.allclose(patched, reference, atol=1e-5)
