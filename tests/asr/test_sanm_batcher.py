"""The ASR batcher (voicebot/asr/sanm/batcher.py): sessions' chunks share model calls, and each
session's tokens equal its tokens decoded alone; failures stay with their rows."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest

from tests.asr.tiny_models import synthetic_speech
from voicebot.asr.sanm.batcher import AsrOverloaded, ParaformerBatcher
from voicebot.asr.sanm.loader import load_paraformer
from voicebot.asr.sanm.model import ChunkConfig
from voicebot.asr.sanm.stream import StreamingParaformer
from voicebot.serving.batcher import StepFailed

DATA = Path(__file__).resolve().parents[1] / "data" / "paraformer"


@pytest.fixture(scope="module")
def engine():
    return StreamingParaformer(load_paraformer(DATA / "model"), ChunkConfig((0, 10, 5), 4, 1))


@pytest.fixture
def batcher(engine):
    batcher = ParaformerBatcher(engine, max_batch=16, max_pending=8)
    batcher.start()
    yield batcher
    batcher.stop()


def _calls(audio: np.ndarray, size: int) -> list[tuple[np.ndarray, bool]]:
    pieces = [audio[i: i + size] for i in range(0, len(audio), size)]
    return [(p, False) for p in pieces] + [(np.zeros(0, np.float32), True)]


def test_sessions_share_steps_and_get_their_own_tokens(engine, batcher):
    audios = [synthetic_speech(s, seed=200 + i) for i, s in enumerate([2.4, 3.1, 1.7, 4.0, 2.9, 0.8])]
    sizes = [9600, 4000, 19200, 9600, 12000, 3200]
    expected = []
    for audio, size in zip(audios, sizes):
        stream = engine.open()
        expected.append([engine.feed(stream, a, f).token_ids for a, f in _calls(audio, size)])

    streams = [engine.open() for _ in audios]
    calls = [_calls(a, s) for a, s in zip(audios, sizes)]
    got: list[list[list[int]]] = [[] for _ in audios]
    # Every session keeps one request in flight, as a live session does; they interleave freely.
    futures = {batcher.submit(streams[i], *calls[i].pop(0)): i for i in range(len(audios))}
    while futures:
        done, _ = concurrent.futures.wait(futures, timeout=60, return_when=concurrent.futures.FIRST_COMPLETED)
        assert done, "the batcher stopped answering"
        for future in done:
            i = futures.pop(future)
            got[i].append(future.result().token_ids)
            if calls[i]:
                futures[batcher.submit(streams[i], *calls[i].pop(0))] = i
    assert got == expected
    assert max(batcher.batch_sizes) > 1  # steps really were shared


def test_a_failing_step_fails_only_its_rows_and_resets_their_streams(engine, batcher, monkeypatch):
    stream = engine.open()
    real_step = engine.step

    def broken(work):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken)
    with pytest.raises(StepFailed, match=r"asr model call of 1 rows failed \(RuntimeError: device lost\)"):
        batcher.submit(stream, synthetic_speech(1.2, seed=3), False).result(timeout=30)
    assert batcher.failed_requests == 1 and stream.state.encoder_kv is None
    monkeypatch.setattr(engine, "step", real_step)
    result = batcher.submit(stream, synthetic_speech(1.2, seed=3), True).result(timeout=30)
    alone = engine.feed(engine.open(), synthetic_speech(1.2, seed=3), True)
    assert result.token_ids == alone.token_ids  # the stream started afresh


def test_bounds_one_request_per_stream_and_max_pending(engine):
    batcher = ParaformerBatcher(engine, max_pending=2)  # not started: requests stay waiting
    a, b, c = engine.open(), engine.open(), engine.open()
    batcher.submit(a, np.zeros(100, np.float32), False)
    with pytest.raises(RuntimeError, match="one request per stream"):
        batcher.submit(a, np.zeros(100, np.float32), False)
    batcher.submit(b, np.zeros(100, np.float32), False)
    with pytest.raises(AsrOverloaded):
        batcher.submit(c, np.zeros(100, np.float32), False)
