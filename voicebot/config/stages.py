"""The sections of the session's audio stages: the noise gate, the endpointer, pacing, the periodic
reset and what goes on air (output)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from voicebot.config.base import Section


class GateConfig(Section):
    enabled: bool = True
    block_ms: float = Field(5.0, gt=0)
    # A block this many background standard deviations above the background mean is a candidate burst.
    threshold_std: float = Field(3.0, gt=0)
    # ... and must also be this many dB above the background mean energy (keeps quiet rooms sane).
    min_rise_db: float = Field(12.0, ge=0)
    # A burst longer than this is not an impulse (it is speech or sustained sound): it passes.
    max_burst_ms: float = Field(50.0, gt=0)
    mute_ms: float = Field(50.0, gt=0)
    # Lookahead used to judge whether a rise is short. Audio waits for it only while a burst may be
    # starting; a block no mute can reach goes out at once (voicebot/audio/gate.py).
    lookahead_ms: float = Field(50.0, ge=0, le=50)
    # Time constant of the background statistics (exponential moving average).
    background_tau_s: float = Field(2.0, gt=0)
    warmup_ms: float = Field(200.0, ge=0)
    # No block taken as background for this long: the room got louder; re-learn its background.
    relearn_s: float = Field(3.0, gt=0)


class EndpointConfig(Section):
    # Silero speech probability above which a 32 ms window counts as speech.
    threshold: float = Field(0.5, gt=0, lt=1)
    # End of utterance after this much silence. 500 ms: below ~400 ms normal pauses between phrases
    # split sentences (measured on espeak speech, and the usual figure for conversational
    # endpointing); every extra 100 ms adds directly to the reply latency.
    endpoint_silence_ms: int = Field(500, ge=100, le=5000)
    # Speech shorter than this is not an utterance (a click the gate let through, a cough).
    min_speech_ms: int = Field(150, ge=0)
    # Audio kept before the detected start so the first phoneme reaches the recognizer.
    pre_speech_ms: int = Field(300, ge=0, le=1000)
    # An utterance is cut (ended) after this long, so no stream grows without bound.
    max_utterance_s: float = Field(30.0, gt=1)
    # What ends a turn: "silence" waits endpoint_silence_ms; "smart" asks Smart Turn v3.2
    # (voicebot/audio/turn.py) whether the turn is complete once a short pause is heard. A server
    # that cannot load the model says so at start-up and in /readyz and uses "silence".
    turn: Literal["smart", "silence"] = "smart"
    # smart (docs/turn-taking.md; the defaults are bench/turn_offline.py's pick on half 0 of the turn
    # sets: the fastest setting with a p95 within 1.1 s on the natural-voice set and no more cut-offs
    # than the silence rule on any set). The first question after this much VAD silence (the action
    # delay; each 32 ms less is 32 ms less latency, at the price of more cut-ins: a "complete" lands
    # inside more of the user's short pauses) ...
    smart_pause_ms: int = Field(160, ge=100, le=2000)
    # ... asked early, at this much VAD silence (0: not), on the audio so far with its silent tail
    # repeated to the pause's length; its answer stands for the pause's if the user stays silent
    # until then. Exact in digital silence; in room noise it agrees with the pause's own answer
    # about as often as two noise samples do (bench/smart_turn.py). Sooner, a "complete" also lands
    # inside more short pauses (at 192 ms and 0.8, asked at 32 ms, cut-ins of espeak 22 -> 24 of 80,
    # Piper 67 -> 76 and 61 -> 67 of 182), which is why it is off by default ...
    smart_early_ms: int = Field(0, ge=0, le=2000)
    # ... then again each time the pause grows by this much while the answer is "incomplete" (each
    # question is a model call: ~80 ms of a core) ...
    smart_reask_ms: int = Field(160, ge=32, le=5000)
    # ... and the turn ends anyway after this much silence (the timeout: a thinking pause, a model
    # that keeps saying "incomplete"). 896: the end-of-speech-to-decision p95 within 1.1 s; it cuts
    # off every pause longer than itself.
    smart_limit_ms: int = Field(896, ge=100, le=10000)
    # Probability of "complete" at or above which the turn ends, at the first question ...
    smart_threshold: float = Field(0.8, gt=0, lt=1)
    # ... falling linearly with the silence asked about to this at smart_limit_ms (equal: flat): the
    # longer the pause, the less sure the model needs to be (the long tail of true ends it never
    # calls complete) ...
    smart_threshold_floor: float = Field(0.6, gt=0, lt=1)
    # ... after the transcript's last words moved the answer, in log-odds (voicebot/audio/turn_words.py;
    # 0: ignored): down when the turn stops on a conjunction, a preposition, an article, a filler
    # (3: 0.95 reads as 0.49) ...
    smart_words_hold: float = Field(3.0, ge=0, le=20)
    # ... up when it ends in a full stop or a question mark (a recognizer that punctuates) or, in
    # Mandarin, on a question particle (2: 0.5 reads as 0.88).
    smart_words_go: float = Field(2.0, ge=0, le=20)
    # smart: start the responder and synthesis on the transcript at each pause, into a holding
    # buffer; sent at once if the turn ends with that transcript, discarded (never heard, never in
    # the history) if the user goes on.
    prepare_replies: bool = True

    @model_validator(mode="after")
    def _smart_order(self) -> "EndpointConfig":
        if self.smart_pause_ms >= self.smart_limit_ms:
            raise ValueError(f"smart_pause_ms ({self.smart_pause_ms}) must be below smart_limit_ms ({self.smart_limit_ms})")
        if self.smart_threshold_floor > self.smart_threshold:
            raise ValueError(f"smart_threshold_floor ({self.smart_threshold_floor}) must not be above smart_threshold "
                             f"({self.smart_threshold})")
        if self.smart_early_ms >= self.smart_pause_ms:
            raise ValueError(f"smart_early_ms ({self.smart_early_ms}) must be below smart_pause_ms ({self.smart_pause_ms})")
        return self


class PacingConfig(Section):
    # Reply frames may be sent at most this far ahead of the client's playback clock.
    lead_ms: int = Field(400, ge=0, le=5000)
    # When synthesis is slower than real time, wait for this much audio before the first frame.
    prebuffer_ms: int = Field(0, ge=0, le=10000)
    # User speech at least this long while the bot speaks interrupts it (a cough does not).
    barge_in_min_ms: int = Field(300, ge=0)


class ResetConfig(Section):
    interval_s: float = Field(1800.0, gt=0)


class OutputConfig(Section):
    """The level of reply audio on air (voicebot/audio/loudness.py): every session's, hence what a
    channel's listeners (the OBS overlay) and /obs/audio's channel get."""

    # Integrated loudness (ITU-R BS.1770 / EBU R128) replies are held at: -16 LUFS sits with
    # streaming platforms' -14 to -16 and podcasts' -16; EBU broadcast is -23. null: as synthesized.
    loudness_lufs: float | None = Field(-16.0, ge=-40.0, le=-5.0)
    # True peak (4x oversampled) ceiling: -1 dBTP leaves room for a platform's lossy encoder.
    true_peak_dbtp: float = Field(-1.0, ge=-12.0, le=0.0)
