"""What ends a session's turns: the server's `endpoint.turn`, or the client's choice; and the VAD
threshold a client may set (/v1/realtime's turn_detection)."""

from __future__ import annotations

from voicebot.audio.endpoint import Endpointer
from voicebot.audio.turn import SmartTurn
from voicebot.config.stages import EndpointConfig
from voicebot.protocol import EndpointingUpdate
from voicebot.session.turn_taking import TurnTaking


class TurnMode:
    def __init__(self, config: EndpointConfig, smart_turn: SmartTurn | None, turn_taking: TurnTaking, endpointer: Endpointer) -> None:
        self._config = config
        self._smart_turn = smart_turn  # None where the end-of-turn model did not load
        self._turn_taking = turn_taking
        self._endpointer = endpointer
        self.wants_smart = config.turn == "smart"
        self.silence_ms = config.endpoint_silence_ms  # the silence rule's wait

    @property
    def name(self) -> str:
        """What ends a turn now: "smart" (the end-of-turn model) or "silence"."""
        return "smart" if self._turn_taking.smart else "silence"

    def apply(self, endpointing: EndpointingUpdate | None) -> None:
        """Take the client's choice, if any (an endpoint_silence_ms alone asks for the silence rule
        with that wait), and set the turn taking and the endpointer's pause by it."""
        if endpointing is not None and endpointing.endpoint_silence_ms:
            self.silence_ms = endpointing.endpoint_silence_ms
            self.wants_smart = False
        if endpointing is not None and endpointing.turn:
            self.wants_smart = endpointing.turn == "smart"
        smart = self._smart_turn if self.wants_smart else None
        self._turn_taking.use(smart)
        # smart: the endpointer ends a segment at the short pause where the model is asked.
        self._endpointer.set_silence_ms(self._config.smart_pause_ms if smart else self.silence_ms)

    def set_vad_threshold(self, threshold: float) -> None:
        """The VAD's speech probability threshold, for this session's endpointer only."""
        self._endpointer.config = self._endpointer.config.model_copy(update={"threshold": threshold})
