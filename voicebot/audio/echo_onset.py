"""Where an utterance begins, and which of its silences are the suppressor's, when the user talks
over the bot's echo (issue 29).

The endpoint rule (audio/endpoint.py) hears AEC3's suppressed output; in double talk over a new
reply the suppressor can take the user's first words down so far that the utterance, and so the
recognizer's audio, starts inside them, and take half a second from inside them, so that the rule
ends the utterance there. EchoOnset, one per session with an echo canceller, watches the suppressed
output's level window by window and moves such an utterance's start back (over a hole it made after
the first word too), and says which windows the suppressor hid (SUPPRESSOR_HID_DB): the endpoint rule does not count those as the user's silence.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from voicebot.audio.endpoint import WINDOW, WINDOW_MS
from voicebot.audio.rates import LISTEN_RATE

# Words spoken over the bot's echo (issue 29): AEC3's suppressor, in double talk over a new reply,
# takes 10-60 dB off each 100 ms of their first 0.7-1.2 s, Silero on its output hears speech only
# after that, and the utterance (so the recognizer's audio, the linear canceller's) started inside
# the words. What the suppressor leaves of them still stands 15-20 dB above its output over the
# echo alone (its floor: the 10th percentile of the last ECHO_HISTORY_S, at least
# ECHO_FLOOR_MIN_DBFS). So an utterance that starts while it suppresses reaches back over the
# windows ECHO_ONSET_DB above that floor, each at most ECHO_GAP_MS before the next (a pause
# between words), from its speech back, to ECHO_MARGIN_MS before the earliest (a first phoneme
# too weak to rise that far), at most ECHO_REACH_S before where the endpoint rule put it. Not the
# whole pre_speech_ms before them: the linear output there is the echo's residual, and with a -6 dB
# echo the grammar recognizer heard fewer of the words after 300 ms of it (bench/echo.py --offline,
# words heard from the utterance's start: the -6 dB rows lost 9 of 108 each against the endpoint
# rule's start; from ECHO_MARGIN_MS before, no row lost any, and 531 of 648 became 575).
# Open: where the suppressor takes the first words down to its floor (a 180 ms path 1.5 s into the
# reply: their first 0.3 s), nothing rises and the endpoint rule's start stands (tests/unit/test_echo.py).
# Its output alone cannot tell them from the echo: over the 180 ms path an echo-only window stood 12-14
# dB over the floor where the words' first stood 3-8. The linear output (MDF 3-10 dB into the echo
# 1.5 s into a first reply) and an energy double-talk rule on the far end (no false trace on a pure
# delay, 5-13% of echo-only blocks in rooms with an RT60 of 0.4-0.8 s) were no better evidence; per 32
# ms window over those words the linear output stood at -20 to -43 dBFS (the echo alone's -19 to -46),
# and the input's correlation with the far end at the path 0.56-0.97 (the echo alone's 0.97-1.00 on this
# pure delay, 0.67-0.95 in rooms: echo_delay.py).
ECHO_REACH_S = 1.2
ECHO_MARGIN_MS = 96
ECHO_HISTORY_S = 3.0  # per session: 94 windows of (level, suppressing, the linear output's level)
ECHO_FLOOR_PERCENTILE = 10
ECHO_FLOOR_MIN_DBFS = -75.0
ECHO_ONSET_DB = 10.0
ECHO_GAP_MS = 300
# Where the suppressor lets the first word through (too short for the endpoint rule) and takes the next
# ~0.45 s, the second word with it, a hole longer than ECHO_GAP_MS (a 240 ms path 1.5 s into the
# reply): the reach stopped there, 0.55 s into the words. So past the earliest window it reached, a hole
# of windows the suppressor hid (SUPPRESSOR_HID_DB), at most ECHO_HOLE_MS (the holes that split words were
# ~0.5 s: endpoint.py's HELD_SILENCE_SHARE), is bridged to a word before it: windows it let through,
# one of them ECHO_HOLE_RISE_DB over its floor, and in the linear output as loud as the hole's median or
# louder. Without that last test an echo-only stretch the suppressor let through (25 dB over its floor,
# the linear output there 3.5 dB under the hole's median) started an utterance 0.53 s before the words
# over a 300 ms path and the recognizer heard none of them (bench/echo.py --offline's 300 ms -6 dB row:
# 78 -> 69 of 108 words). With it the bridge changes one start of 132 offline cases (the 240 ms one:
# 0.55 s into the words -> 0.06 s before them; the bench's 96 and test_echo's 36 at 60-300 ms,
# 1.25-2.5 s into the reply): evidence from one case, which the next hole measured should test.
ECHO_HOLE_MS = 512
ECHO_HOLE_RISE_DB = 20.0
# A window the suppressor hid: AEC3's output SUPPRESSOR_HID_DB or more under the linear canceller's
# (linear_echo.py), which has the same near and far ends and subtracts its echo estimate without
# suppressing anything, and the linear output over SUPPRESSOR_HID_MIN_DBFS: something was there, and
# the suppressor took it. It cannot tell what: the user's words or the echo alone. Per 32 ms window
# while it suppressed, over bench/echo.py --offline's input (3 replies, barge-ins 1.5-2.5 s in; 50-300 ms
# paths at -6 and -20 dB, and two rooms with a tail, RT60 0.4 and 0.8 s; 16,000 windows): the echo alone
# 20-64 dB under (p5-p95; 95% at 20 or more), the words the endpoint rule heard as silence (Silero
# under its threshold on AEC3's output) 28 dB at the median (64% at 20 or more, 56-71% from 25 to 15:
# the rule is no finer than that), and the words it heard as speech 3 dB (85% under 20; it never holds
# those). The hidden words' linear output was -44 to -24 dBFS (p10-p90), the echo's -57 to -33; where
# neither the user nor an echo over -60 dBFS was there (the reply's pauses, its tail) the gap was 20 dB
# or more in 45% of the windows, the linear output there -78 to -52 dBFS: the level floor keeps
# those, and a microphone's own noise floor (-70 to -60 dBFS), the user's silence.
SUPPRESSOR_HID_DB = 20.0
SUPPRESSOR_HID_MIN_DBFS = -55.0


class EchoOnset:
    """Where an utterance that starts while AEC3 suppresses began: see ECHO_REACH_S. It decides on
    the suppressed output's level, window by window, and only while the canceller suppresses: a
    session with no echo canceller, or where it found no echo, is left as the endpoint rule has it."""

    def __init__(self) -> None:
        # (level, suppressing, the linear output's level there: None until `hid` was asked)
        self._windows: deque[tuple[float, bool, float | None]] = deque(maxlen=round(ECHO_HISTORY_S * 1000 / WINDOW_MS))

    def observe(self, window: np.ndarray, suppressing: bool) -> None:
        """The next VAD window of the suppressed output, and whether the canceller suppressed in it."""
        self._windows.append((_level_db(window), suppressing, None))

    def hid(self, linear: np.ndarray) -> bool:
        """Whether the suppressor hid what was in the window observed last, given the linear output
        at its samples (see SUPPRESSOR_HID_DB); kept for `start`."""
        level, suppressing, _ = self._windows[-1]
        linear_level = _level_db(linear)
        self._windows[-1] = (level, suppressing, linear_level)
        return _hidden(level, suppressing, linear_level)

    def start(self, start: int, end: int, not_before: int) -> int:
        """The start of an utterance the endpoint rule began at `start` (pre-speech included), the
        last window observed ending at `end`: earlier where the words run on before its first speech,
        never before `not_before` (where the utterance before it ended: its audio is that one's)."""
        history = list(self._windows)
        reach = min(len(history), (end - start) // WINDOW + round(ECHO_REACH_S * 1000 / WINDOW_MS))
        floor = max(float(np.percentile([level for level, _, _ in history], ECHO_FLOOR_PERCENTILE)), ECHO_FLOOR_MIN_DBFS)
        earliest, gap = None, 0  # windows back from `end`
        for back in range(1, reach + 1):  # from the utterance's latest window back over its speech, its pre-roll and before
            level, suppressing, _ = history[-back]
            if not suppressing:
                break
            if level >= floor + ECHO_ONSET_DB:
                earliest, gap = back, 0
            elif (gap := gap + 1) > ECHO_GAP_MS / WINDOW_MS:
                break
        if earliest is None:
            return start
        earliest = _before_the_hole(history[-reach:], earliest, floor)
        return max(not_before, min(start, end - earliest * WINDOW - round(ECHO_MARGIN_MS * LISTEN_RATE / 1000)))


def _hidden(level: float, suppressing: bool, linear_level: float | None) -> bool:
    return (suppressing and linear_level is not None and linear_level >= SUPPRESSOR_HID_MIN_DBFS
            and linear_level - level >= SUPPRESSOR_HID_DB)


def _before_the_hole(history: list[tuple[float, bool, float | None]], earliest: int, floor: float) -> int:
    """`earliest` (windows back from the end of `history`), or further back where the windows before it
    are a hole the suppressor made inside the words (hidden, at most ECHO_HOLE_MS) after a word it let
    through (ECHO_HOLE_RISE_DB over its floor, and in the linear output no quieter than the hole): that
    word's first window."""
    back = earliest + 1
    while back <= len(history) and _hidden(*history[-back]) and history[-back][0] < floor + ECHO_ONSET_DB:
        back += 1
    hole = [linear for _, _, linear in history[-back + 1 : -earliest]]
    if not 0 < len(hole) <= ECHO_HOLE_MS / WINDOW_MS:
        return earliest
    word = back  # back over the windows it let through
    while word <= len(history) and history[-word][1] and history[-word][0] >= floor + ECHO_ONSET_DB:
        word += 1
    let_through = history[len(history) - word + 1 : len(history) - back + 1]
    if (not let_through or max(level for level, _, _ in let_through) < floor + ECHO_HOLE_RISE_DB
            or max(-np.inf if linear is None else linear for _, _, linear in let_through) < float(np.median(hole))):
        return earliest
    return word - 1


def _level_db(window: np.ndarray) -> float:
    return 10 * float(np.log10(np.dot(window, window) / len(window) + 1e-18))
