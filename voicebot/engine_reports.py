"""What every engine (recognizer, responder, synthesizer) reports: its reset, and itself to /readyz.

The interfaces themselves: voicebot/engines.py lists them, and builds the engines a config selects.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResetReport:
    """What a periodic reset did to one engine's per-session state.

    `generation` increases by one at every reset, so a test (or an operator) can see that state was
    really dropped and rebuilt, not skipped; `bytes_freed` is the size of the state that was dropped.
    `skipped`: the engine could not rebuild its state this time and keeps the old (the generation
    stays); the session reports it apart, as not reset.
    """

    engine: str
    generation: int
    bytes_freed: int
    skipped: bool = False


@dataclass
class EngineInfo:
    """What /readyz reports about one loaded engine."""

    kind: str  # "asr" | "tts" | "reply" | "vad"
    name: str
    device: str = "cpu"
    loaded: bool = False
    details: dict = field(default_factory=dict)
