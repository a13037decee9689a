"""What the device scheduler (voicebot/serving/scheduler.py) needs of the models it runs: an LM's
rows, batched (`DecodePool`, `DecodeRow`), and a render still running on the device (`Rendering`).
A model implements them beside itself (voicebot/tts/cosyvoice2/lm_pool.py, token2wav.py); this
package imports no model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class PoolFull(RuntimeError):
    """Every LM slot is in use."""


class DecodeRow(Protocol):
    """One utterance's slot in a `DecodePool`."""

    closed: bool

    @property
    def waiting(self) -> int:
        """Positions of its pending step not yet fed: 1, a decode step; more, prefill first; 0, none."""

    @property
    def step(self) -> object | None:
        """What it waits for; None once its program has ended."""

    def take(self) -> list[int]:
        """The tokens emitted since the last take."""


class DecodePool(Protocol):
    """What the scheduler steps: an LM's rows, batched."""

    slots: int

    @property
    def free(self) -> int: ...

    def open(self, sampler: Any, prefix: Any = None) -> DecodeRow:
        """A slot for a new utterance; raises PoolFull when none is free."""

    def close(self, row: DecodeRow) -> None: ...

    def decode(self, rows: list[DecodeRow]) -> None:
        """One batched step of rows each waiting on one position."""

    def prefill(self, row: DecodeRow) -> None:
        """One chunk of the row's longer step."""

    def step_sizes(self, top: int) -> list[int]:
        """The batch sizes up to `top` calibration times (and captures graphs for)."""

    def open_idle(self, steps: int, context: int) -> DecodeRow:
        """A row fed throwaway one-position steps (calibration)."""

    def synchronize(self) -> None:
        """Wait for the device (timing)."""

    def nbytes(self) -> int: ...


@dataclass(eq=False)
class Rendering:
    """A render call still running on the device: `ready()` says (never blocking) whether it is
    done; `audio()` waits for it and gives each chunk's audio (24 kHz float32). A render that
    returns a list has rendered already (CPU)."""

    ready: Callable[[], bool]
    audio: Callable[[], list[np.ndarray]]


def as_rendering(rendered: list[np.ndarray] | Rendering) -> Rendering:
    if isinstance(rendered, Rendering):
        return rendered
    return Rendering(ready=lambda: True, audio=lambda: rendered)


def finished(rendered: list[np.ndarray] | Rendering) -> list[np.ndarray]:
    """The audio of a render call, waited for."""
    return as_rendering(rendered).audio()
