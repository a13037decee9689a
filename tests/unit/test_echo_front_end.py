"""The front end with an echo canceller: the endpoint rule on AEC3's suppressed output, the audio
the recognizer gets from the linear one, at the same sample positions, muted where the gate muted."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from tests.audio import espeak_speech, to_pcm16
from voicebot.audio.echo import Cancelled
from voicebot.audio.endpoint import EventKind
from voicebot.config.stages import EndpointConfig, GateConfig
from voicebot.messages import AudioIn
from voicebot.session.listening import FrontEnd


class HalvingCanceller:
    """An echo canceller's two outputs told apart: the suppressed one is the input, the linear one half of it."""

    suppressing = False  # an utterance's start is the endpoint rule's (EchoOnset stays out of it)

    def process(self, audio: np.ndarray, arrived: float | None = None) -> Cancelled:
        return Cancelled(audio, audio * np.float32(0.5))


def test_the_recognizer_gets_the_linear_output_where_the_endpointer_heard_the_suppressed(input_clock):
    rate = 16000
    speech = espeak_speech("what time does the show start tomorrow") * 0.5
    room = np.random.default_rng(0).normal(0, 1e-3, rate).astype(np.float32)
    click = room.copy()
    click[rate // 2 + 800 : rate // 2 + 816] = 0.9  # 1 ms, in the pre-speech audio: the gate mutes it
    audio = np.concatenate([room, click, speech, room, room])

    async def run(echo) -> tuple[FrontEnd, list, list[np.ndarray]]:
        front = FrontEnd(rate, GateConfig(), EndpointConfig(), echo)
        events, heard = [], []
        for start in range(0, len(audio), 3200):  # 200 ms chunks
            out = await front.process(AudioIn(to_pcm16(audio[start : start + 3200]), time.monotonic()), input_clock)
            events += out.events
            if any(e.kind is EventKind.START for e in out.events):
                heard.append(front.audio_since(front.speech_start_sample))
        return front, events, heard

    plain, plain_events, plain_heard = asyncio.run(run(None))
    split, split_events, split_heard = asyncio.run(run(HalvingCanceller()))
    assert plain.gate.muted_samples > 0 and split.gate.muted_samples == plain.gate.muted_samples
    assert [(e.kind, len(e.audio)) for e in split_events] == [(e.kind, len(e.audio)) for e in plain_events]
    assert [e.kind for e in plain_events].count(EventKind.START) == 1
    assert [e.kind for e in plain_events][-1] is EventKind.END
    for plain_event, split_event in zip(plain_events, split_events):
        np.testing.assert_array_equal(split_event.audio, plain_event.audio * np.float32(0.5))
    clicked = slice(rate + rate // 2 + 800, rate + rate // 2 + 816)
    assert not np.any(split.audio_since(0)[clicked]) and not np.any(plain.audio_since(0)[clicked])  # muted in both
    np.testing.assert_array_equal(split_heard[0], plain_heard[0] * np.float32(0.5))
