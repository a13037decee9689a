"""The recognizer's echo canceller: speexdsp's MDF adaptive filter alone, through ctypes.

AEC3's suppressor (its non-linear stage, voicebot/audio/echo.py) takes 5-27 dB off each 100 ms of
the first 0.6-0.9 s of a user talking over the reply's echo, and the recognizer made '' of that. The
recognizer needs the words: it gets the output of a linear canceller, speexdsp's MDF adaptive filter
alone (`LinearCanceller`; its preprocessor, the residual echo suppressor, never runs), fed the same
far end, so the echo's estimate is subtracted and nothing else is touched. AEC3's own linear output
(`GetLinearAecOutput`) is in no PyPI binding (not `aec-audio-processing`, `pywebrtc-audio`, nor
livekit's APM). MDF has no delay search of its own and converges slowly (in time proportional to its
length): its filter covers `LINEAR_FILTER_S`, and EchoCanceller holds the far end back by the path
less `LINEAR_MARGIN_S`, on an early estimate of the tracker's (voicebot/audio/echo_delay.py,
`EARLY_WINDOW_S`, within ~0.75 s of a new reply) until its own is settled. What MDF learnt is kept
from one reply to the next; only a move of its hold starts it again. bench/echo.py --offline,
barge-ins 1.5-2.5 s into a first reply: the words lost ~0.9 dB on average in the linear output (~3 dB
in its worst 200 ms) where the suppressed one lost 3-15 dB (6-46 dB); the echo under them was 8-17 dB
down (0.2-14 dB before the early hold), 24-28 dB in a second reply's first second (9-23 before;
tests/unit/test_echo.py); the recognizer heard every word of them (92% before).

Without the system library (libspeexdsp1) the recognizer hears AEC3's suppressed output, and
`linear_canceller_problem` says so (start-up log, /readyz).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import weakref

import numpy as np

from voicebot.audio.rates import LISTEN_RATE

BLOCK = 160  # both cancellers and the delay tracker work on the LISTEN_RATE input in 10 ms blocks (AEC3's, MDF's frame here)
# The linear canceller's filter: 16 blocks, 160 ms of echo path. MDF adapts too slowly for a new
# reply's first seconds (its step is normalised over the whole filter, and set by an estimate of
# the echo left that itself takes ~2 s to follow): with 250 ms of filter a 150 ms -6 dB path was
# 2-7 dB down 0.5-2.5 s into the first reply, and a 300 ms one, beyond it until the tracker's hold
# (~3 s), 0 dB. So the far end is held back until the direct path sits LINEAR_MARGIN_S into the
# filter, on the tracker's early estimate, from ~0.75 s into the reply; the room's first ~120 ms
# fit behind it. bench/echo.py --offline (barge-ins 1.5-2.5 s into 3 first replies): the recognizer
# heard 92% of the words before (the echo under them 0.2-0.4 dB down at 300 ms, 7-10 at 150 ms),
# 98% with the early hold and 250 ms of filter, all of them with 160 ms (8-11 dB down at 300 ms,
# 9-12 at 150 ms). 80-120 ms took 1-3 dB more, but off a pure delay: a room's tail needs the length.
LINEAR_FILTER_S = 0.16
SPEEX_ECHO_SET_SAMPLING_RATE = 24  # speex_echo.h


SPEEXDSP_MISSING = ("libspeexdsp is not installed (Debian: libspeexdsp1; scripts/setup installs it): the recognizer "
                    "hears AEC3's suppressed output, which loses the first words spoken over the bot's echo")


@functools.cache
def _speexdsp() -> ctypes.CDLL | None:
    """The system's libspeexdsp, looked up once (find_library runs ldconfig); None where it is missing."""
    path = ctypes.util.find_library("speexdsp")
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    lib.speex_echo_state_init.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.speex_echo_state_init.restype = ctypes.c_void_p
    lib.speex_echo_ctl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.speex_echo_cancellation.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.speex_echo_cancellation.restype = None
    lib.speex_echo_state_destroy.argtypes = [ctypes.c_void_p]
    lib.speex_echo_state_reset.argtypes = [ctypes.c_void_p]
    return lib


def linear_canceller_problem() -> str | None:
    """Why the recognizer cannot hear the linear canceller (start-up log, /readyz); None when it can."""
    return SPEEXDSP_MISSING if _speexdsp() is None else None


class LinearCanceller:
    """speexdsp's MDF adaptive filter on 10 ms blocks: the echo it predicts from the far end, subtracted."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self._lib = lib or _speexdsp()
        if self._lib is None:
            raise RuntimeError(SPEEXDSP_MISSING)
        lib = self._lib
        self._state = lib.speex_echo_state_init(BLOCK, round(LINEAR_FILTER_S * LISTEN_RATE))
        rate = ctypes.c_int(LISTEN_RATE)
        lib.speex_echo_ctl(self._state, SPEEX_ECHO_SET_SAMPLING_RATE, ctypes.byref(rate))
        weakref.finalize(self, lib.speex_echo_state_destroy, self._state)
        self._out = np.zeros(BLOCK, "<i2")

    def process(self, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        """One block of each end, int16; the near end less the echo, float32."""
        near, far = np.ascontiguousarray(near), np.ascontiguousarray(far)
        self._lib.speex_echo_cancellation(self._state, near.ctypes.data, far.ctypes.data, self._out.ctypes.data)
        return self._out.astype(np.float32) / 32768.0

    def reset(self) -> None:
        """Start adapting afresh (the far end was shifted: what the filter learnt is misplaced)."""
        self._lib.speex_echo_state_reset(self._state)
