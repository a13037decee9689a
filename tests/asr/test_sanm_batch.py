"""A stream's result in a batch equals its result alone (voicebot/asr/sanm).

Streams of different lengths join and leave between steps, end utterances (tail chunks and short
final pieces) while others are mid-utterance, with look-backs that leave their caches at different
lengths; each stream's tokens must equal its batch-1 tokens and its encoder output stay within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.asr.tiny_models import synthetic_speech
from voicebot.asr.sanm.loader import load_paraformer
from voicebot.asr.sanm.model import ChunkConfig
from voicebot.asr.sanm.stream import StreamingParaformer

DATA = Path(__file__).resolve().parents[1] / "data" / "paraformer"


@pytest.fixture(scope="module")
def loaded():
    return load_paraformer(DATA / "model")


def _utterances(n: int) -> list[np.ndarray]:
    # Lengths chosen to end with a long final piece, a tail under 960 samples, and exact strides.
    seconds = [2.3, 3.0 + 100 / 16000, 4.8, 1.0, 3.7, 0.5, 2.9, 5.5]
    return [synthetic_speech(seconds[i % len(seconds)], seed=100 + i) for i in range(n)]


@pytest.mark.parametrize("geometry", [((0, 10, 5), 4, 1), ((5, 10, 5), 1, 2), ((0, 8, 4), 0, 0), ((0, 5, 5), -1, -1)])
def test_batched_streams_equal_each_stream_alone(loaded, geometry):
    chunk = ChunkConfig(*geometry)
    engine = StreamingParaformer(loaded, chunk)
    audios = _utterances(8)

    alone = []
    for audio in audios:
        stream = engine.open()
        alone.append(engine.feed(stream, audio, True).steps)

    streams = [engine.open() for _ in audios]
    queues = [stream.pieces(audio, True) for stream, audio in zip(streams, audios)]
    starts = [0, 0, 1, 3, 3, 5, 2, 7]  # steps at which each stream joins
    batched: list[list] = [[] for _ in audios]
    batch_sizes = []
    step = 0
    while any(queues):
        work = [(i, streams[i], queues[i].pop(0)) for i in range(len(audios)) if queues[i] and starts[i] <= step]
        if work:
            outputs = engine.step([(stream, piece) for _, stream, piece in work])
            for (i, _, _), out in zip(work, outputs):
                batched[i] += out.steps
            batch_sizes.append(len(work))
        step += 1
    assert max(batch_sizes) >= 6 and min(batch_sizes) <= 2  # rows really joined and left

    for i, (ours, reference) in enumerate(zip(batched, alone)):
        assert len(ours) == len(reference)
        for s, (a, b) in enumerate(zip(ours, reference)):
            assert a.token_ids == b.token_ids, f"stream {i} step {s}: tokens differ in the batch"
            assert a.encoder_out.shape == b.encoder_out.shape
            assert (a.encoder_out - b.encoder_out).abs().max().item() <= 1e-4, f"stream {i} step {s}"
            assert (a.alphas - b.alphas).abs().max().item() <= 1e-4


def test_a_stream_steps_at_most_once_per_batch(loaded):
    engine = StreamingParaformer(loaded, ChunkConfig())
    stream = engine.open()
    pieces = stream.pieces(synthetic_speech(1.3, seed=1), False)
    with pytest.raises(ValueError, match="one piece per stream"):
        engine.step([(stream, pieces[0]), (stream, pieces[1])])


def test_state_is_bounded_by_the_look_back(loaded):
    chunk = ChunkConfig((0, 10, 5), 4, 1)
    engine = StreamingParaformer(loaded, chunk)
    stream = engine.open()
    sizes = []
    for piece in stream.pieces(synthetic_speech(12.0, seed=2), False):
        engine.step([(stream, piece)])
        sizes.append(stream.state_bytes())
    assert stream.state.encoder_kv.shape[3] == 4 * 10 and stream.state.decoder_kv.shape[3] == 10
    assert sizes[-1] == sizes[len(sizes) // 2]  # flat once the look-back is full
    assert torch.is_tensor(stream.state.cif_alpha)
