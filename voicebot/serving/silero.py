"""The Silero VAD model: one onnxruntime session, each stream's recurrent state, a batched step.

The model ships in the `silero-vad` wheel; one onnxruntime session is shared by every stream (`run`
is thread-safe) and each stream keeps its own recurrent state and context. Audio is 16 kHz float32,
judged in 32 ms windows (512 samples). The graph takes a batch: `silero_step` judges one window of
each of several streams in one call (voicebot/serving/vad.py batches the sessions' windows that
way), each row reading and writing its own stream's state. What the probabilities mean for a turn
is voicebot/audio/endpoint.py's rule.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000  # the graph's rate: the server listens at it (voicebot/audio/rates.py LISTEN_RATE)
WINDOW = 512
CONTEXT = 64
_RATE = np.array(SAMPLE_RATE, dtype=np.int64)


@functools.lru_cache(maxsize=1)
def silero_session():
    import onnxruntime
    import silero_vad

    # The 16 kHz graph without If branches: the same probabilities (to 5e-7) as silero_vad.onnx,
    # about 13 % less time per window (bench/hotpath.py).
    path = Path(silero_vad.__file__).parent / "data" / "silero_vad_op18_ifless.onnx"
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # the graph carries unused initializers; onnxruntime warns about each
    return onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


class SileroVad:
    """One stream's recurrent state and context; the speech probability of its windows."""

    def __init__(self) -> None:
        self.state = np.zeros((2, 1, 128), np.float32)
        self.context = np.zeros((1, CONTEXT), np.float32)

    def probabilities(self, windows: np.ndarray) -> np.ndarray:
        """The windows (k, WINDOW) of this stream in order, one call each (batch 1)."""
        return np.array([silero_step([self], window[None])[0] for window in windows], np.float32)


def silero_step(vads: Sequence[SileroVad], windows: np.ndarray) -> np.ndarray:
    """The next window (B, WINDOW) of each of B streams in one onnxruntime call; each stream's
    state and context move on by that window. The rows do not mix: a row's probability equals
    its stream's call alone (tests/serving/test_vad.py)."""
    x = np.concatenate([np.concatenate([v.context for v in vads]), windows], axis=1)
    state = np.concatenate([v.state for v in vads], axis=1)
    prob, state = silero_session().run(None, {"input": x, "state": state, "sr": _RATE})
    for i, vad in enumerate(vads):
        vad.state = state[:, i : i + 1]
        vad.context = x[i : i + 1, -CONTEXT:]
    return prob[:, 0]
