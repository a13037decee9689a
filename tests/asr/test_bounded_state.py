"""Thousands of chunks over many utterances: every per-stream cache stays within its bound."""

from __future__ import annotations

import asyncio

import numpy as np

from tests.asr.tiny_models import synthetic_speech
from voicebot.asr.funasr_model import state_bytes
from voicebot.asr.paraformer import ParaformerRecognizer
from voicebot.config.engines import DialectFallbackConfig, ParaformerConfig
from voicebot.config.stages import EndpointConfig

PIECE = 1600  # 100 ms, a typical WebSocket frame
CHUNKS = 2000  # 200 s of audio


def test_stream_state_is_bounded(tiny_models):
    config = ParaformerConfig(
        model=str(tiny_models["streaming"]),
        # A dialect model makes the stream keep each utterance's audio: that must stay bounded too.
        dialect=DialectFallbackConfig(model=str(tiny_models["streaming-unsure"])),
    )
    max_utterance_s = 8.0
    recognizer = ParaformerRecognizer(config, EndpointConfig(max_utterance_s=max_utterance_s))
    recognizer.load()
    audio = synthetic_speech(40.0, seed=30)
    rng = np.random.default_rng(0)

    async def run() -> tuple[list[tuple[int, int]], list[int], int]:
        stream = recognizer.open()
        cache_sizes, audio_sizes, utterances = [], [], 0
        position, left_in_utterance, in_utterance = 0, 0, 0
        for _ in range(CHUNKS):
            if left_in_utterance == 0:
                # Utterances of 0.5-12 s: some longer than what is kept for the second pass.
                left_in_utterance = int(rng.integers(5, 120))
            piece = audio[position % len(audio) :][:PIECE]
            position += PIECE
            await stream.accept(piece)
            in_utterance += 1
            cache = state_bytes(stream._primary.cache)
            cache_sizes.append((in_utterance, cache))
            audio_sizes.append(stream.state_bytes() - cache)
            left_in_utterance -= 1
            if left_in_utterance == 0:
                in_utterance = 0
                await stream.finish()
                utterances += 1
        return cache_sizes, audio_sizes, utterances

    try:
        cache_sizes, audio_sizes, utterances = asyncio.run(run())
    finally:
        recognizer.close()

    assert utterances > 25
    # The funasr cache fills its look-back window (4 encoder chunks of 600 ms) in the first
    # seconds of an utterance and then stays flat: later in an utterance it is never larger. With
    # an unbounded look-back (-1) it would keep growing and this would fail.
    # The audio funasr holds back until a whole 600 ms stride has arrived varies within a stride.
    stride_bytes = 9600 * 4
    bound = max(size for position, size in cache_sizes if position <= 50) + stride_bytes
    assert max(size for _, size in cache_sizes) <= bound
    assert any(position > 100 for position, _ in cache_sizes)  # some utterances ran past 10 s
    # After each utterance's finish, nothing of it is left.
    assert min(size for _, size in cache_sizes) < bound / 4
    assert max(audio_sizes) <= max_utterance_s * 16000 * 4
