"""Send reply frames at the listener's playback rate, with a bounded lead.

Frames are produced as fast as synthesis runs, but sent only `lead_ms` ahead of the client's
playback clock, so an interruption is quick (at most the lead is already on its way) and we know
what the listener has heard. The clock starts when the first frame is sent. A frame sent after
the moment the client needed it is an underrun: it is counted and the clock moves on from it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from voicebot.text import joined


@dataclass
class SpokenSegment:
    """One sentence (or utterance) of a reply and where its audio lies in the reply (24 kHz samples)."""

    text: str
    start: int
    end: int


@dataclass
class Pacer:
    frame_ms: int
    lead_ms: int
    clock: callable = time.monotonic
    frames_sent: int = 0
    samples_sent: int = 0
    underruns: int = 0
    _t0: float | None = None
    _sent_ms: float = 0.0

    async def wait_turn(self) -> None:
        """Sleep until the next frame may be sent."""
        if self._t0 is None:
            return
        delay = self._t0 + (self._sent_ms - self.lead_ms) / 1000 - self.clock()
        if delay > 0:
            await asyncio.sleep(delay)

    def sent(self, samples: int, sample_rate: int) -> None:
        now = self.clock()
        if self._t0 is None:
            self._t0 = now
        elif now > self._t0 + self._sent_ms / 1000:
            # The client ran dry before this frame arrived: its playback restarts now.
            self.underruns += 1
            self._t0 = now - self._sent_ms / 1000
        self.frames_sent += 1
        self.samples_sent += samples
        self._sent_ms += samples * 1000 / sample_rate

    def played_ms(self) -> float:
        """What the client has played so far: the audio sent, less what is still in its buffer."""
        if self._t0 is None:
            return 0.0
        return max(0.0, min(self._sent_ms, (self.clock() - self._t0) * 1000))


@dataclass
class HeardText:
    """Which words of a reply the listener heard, from the segments' audio positions."""

    segments: list[SpokenSegment] = field(default_factory=list)

    def add(self, text: str, segment_index: int, start: int, samples: int) -> None:
        if segment_index < len(self.segments):
            # A segment's text may grow with its audio (CosyVoice 2 bistream voices a whole
            # utterance, sentence after sentence, as one segment).
            self.segments[segment_index].text = text
            self.segments[segment_index].end = start + samples
        else:
            self.segments.append(SpokenSegment(text, start, start + samples))

    def heard(self, played_samples: int) -> str:
        parts = []
        for seg in self.segments:
            if played_samples >= seg.end:
                parts.append(seg.text)
                continue
            if played_samples > seg.start:
                fraction = (played_samples - seg.start) / max(1, seg.end - seg.start)
                parts.append(_prefix(seg.text, fraction))
            break
        return joined(parts)  # Chinese sentences join without a space, English ones with one


def _prefix(text: str, fraction: float) -> str:
    """The first `fraction` of a sentence, cut at a word boundary when it has spaces."""
    cut = int(len(text) * fraction)
    if " " in text[:cut]:
        return text[:cut].rsplit(" ", 1)[0]
    return text[:cut] if " " not in text else ""
