import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from voicebot.audio.framing import Framer


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=12000), max_size=40))
def test_any_chunking_gives_exact_frames_with_no_sample_lost_duplicated_or_reordered(sizes):
    total = sum(sizes)
    signal = np.arange(total, dtype=np.float32)  # every sample unique and ordered
    framer = Framer(24000, 200)
    frames, pos = [], 0
    for n in sizes:
        frames.extend(framer.push(signal[pos : pos + n]))
        pos += n
    last = framer.flush()
    assert all(len(f) == 4800 for f in frames)
    if last is not None:
        assert 0 < len(last) < 4800
        frames.append(last)
    out = np.concatenate(frames) if frames else np.zeros(0, np.float32)
    np.testing.assert_array_equal(out, signal)


def test_first_frame_leaves_as_soon_as_200_ms_exist():
    framer = Framer(24000, 200)
    assert framer.push(np.zeros(4799, np.float32)) == []
    assert len(framer.push(np.zeros(1, np.float32))) == 1
    assert framer.flush() is None


def test_clear_drops_pending_samples():
    framer = Framer(24000, 200)
    framer.push(np.zeros(100, np.float32))
    assert framer.clear() == 100
    assert framer.flush() is None
