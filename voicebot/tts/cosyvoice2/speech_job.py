"""One CosyVoice 2 utterance in flight on the device's scheduler (`SpeechJob`), and the clock its
requests' deadlines come from (`PlaybackClock`).

`SpeechJob.chunks` is the step loop: tokens up to the next chunk boundary, then that chunk's audio,
so each session's generator is drawn in one fixed order whoever else is speaking, and a cancelled
reply leaves the batch at the next step.
"""

from __future__ import annotations

import time
from typing import AsyncIterator

import numpy as np

from voicebot.serving.scheduler import Scheduler
from voicebot.tts.base import SAMPLE_RATE
from voicebot.tts.cosyvoice2.bistream_text import BistreamText
from voicebot.tts.cosyvoice2.lm_pool import LMRow
from voicebot.tts.cosyvoice2.token2wav_stream import Token2WavStream


class PlaybackClock:
    """When a session's listener runs out of the audio yielded so far: the deadline of its
    requests. A new reply has nothing buffered, so its first requests are already due."""

    def __init__(self) -> None:
        self.until = 0.0

    def reply_started(self) -> None:
        self.until = time.monotonic()

    def deadline(self) -> float:
        return self.until

    def played(self, samples: int) -> None:
        self.until = max(self.until, time.monotonic()) + samples / SAMPLE_RATE


class SpeechJob:
    """One utterance in flight: its LM row (a slot of the pool, fed by one program after another)
    and the Token2WavStream its tokens render through.

    `chunks()` is the step loop every driver uses (the synthesizer's contexts, bench/, tests): it
    asks the scheduler for the tokens up to the next chunk boundary, then for that chunk's audio,
    until the row's program ends. `close()` frees the slot (always call it: a cancelled reply
    included). The stream's token list is touched here, on the loop, only while no request of it
    is in flight.
    """

    def __init__(self, scheduler: Scheduler, row: LMRow, stream: Token2WavStream, clock: PlaybackClock,
                 bistream: BistreamText | None = None) -> None:
        self.scheduler, self.row, self.stream, self.clock = scheduler, row, stream, clock
        self.bistream = bistream  # the text side of a bistream utterance

    async def chunks(self, finish: bool) -> AsyncIterator[np.ndarray]:
        """Audio until the row's program ends, then the utterance's last chunk if `finish`."""
        ended = False
        while not ended:
            # Never decode past the next chunk's last token: its audio goes out first.
            wanted = max(1, self.stream.tokens_for_next_chunk - len(self.stream.tokens))
            tokens, ended = await self.scheduler.decode(self.row, wanted, self.clock.deadline())
            self.stream.add(tokens)
            async for piece in self._ready():
                yield piece
        if finish:
            self.stream.end()
            async for piece in self._ready():  # the last chunk
                yield piece

    async def _ready(self) -> AsyncIterator[np.ndarray]:
        while (chunk := self.stream.next_chunk()) is not None:
            audio = await self.scheduler.render(chunk, self.clock.deadline())
            if audio.size:  # the fast vocoder may hold a whole chunk back
                self.clock.played(len(audio))
                yield audio

    def close(self) -> None:
        self.stream.close()  # first: its flow slot is free before its LM slot can open another stream
        self.scheduler.release(self.row)
