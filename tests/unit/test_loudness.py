"""voicebot/audio/loudness.py on real (espeak) speech, measured with pyloudnorm (ITU-R BS.1770):
replies streamed in TTS-sized chunks come out at the target within 1 LU whatever their input level,
under the true-peak ceiling, whole (every sample), without pumping, and silence is not boosted."""

from __future__ import annotations

import numpy as np
import pyloudnorm
import pytest
import soxr

from tests.audio import espeak_speech
from voicebot.audio.loudness import MAX_GAIN_DB, MAX_SLEW_DB_PER_S, LoudnessMeter, OutputLevel
from voicebot.audio.rates import SPEAK_RATE
from voicebot.config.stages import OutputConfig

SENTENCE = "please tell me a joke about the weather and what time does the show start tomorrow"


def speech() -> np.ndarray:
    return espeak_speech(SENTENCE, rate=SPEAK_RATE)  # peak 0.5, about -24.5 LUFS


def integrated(audio: np.ndarray) -> float:
    return pyloudnorm.Meter(SPEAK_RATE).integrated_loudness(audio.astype(np.float64))


def true_peak_dbtp(audio: np.ndarray) -> float:
    """4x oversampled with soxr (not the limiter's own interpolator)."""
    return 20 * np.log10(np.abs(soxr.resample(audio.astype(np.float64), SPEAK_RATE, 4 * SPEAK_RATE, "VHQ")).max())


def stream(level: OutputLevel, audio: np.ndarray, seed: int = 0) -> np.ndarray:
    """One reply through `level`, in chunks of 0.1-1 s as a TTS sends them."""
    reply, rng, out, i = level.reply(), np.random.default_rng(seed), [], 0
    while i < len(audio):
        n = int(rng.integers(SPEAK_RATE // 10, SPEAK_RATE))
        out.append(reply.process(audio[i : i + n].astype(np.float32)))
        i += n
    out.append(reply.flush())
    return np.concatenate(out)


@pytest.mark.parametrize("scale", [0.4, 1.0, 2.0], ids=["quiet", "as-synthesized", "hot"])  # -32.5, -24.5, -18.5 LUFS
@pytest.mark.parametrize("target, ceiling", [(-16.0, -1.0), (-23.0, -2.0)], ids=["streaming", "ebu-r128"])
def test_every_reply_comes_out_at_the_target_under_the_true_peak_ceiling(scale, target, ceiling):
    level = OutputLevel(SPEAK_RATE, OutputConfig(loudness_lufs=target, true_peak_dbtp=ceiling))
    for seed in range(3):  # the first reply as much as the later ones
        reply = stream(level, speech() * scale, seed)
        assert abs(integrated(reply) - target) <= 1.0, f"reply {seed}: {integrated(reply):.2f} LUFS"
        assert true_peak_dbtp(reply) <= ceiling + 0.1  # the two interpolators differ by hundredths of a dB


def test_every_sample_comes_out_in_order():
    audio = speech()
    reply = stream(OutputLevel(SPEAK_RATE, OutputConfig()), audio)
    assert len(reply) == len(audio)
    # Only a gain was applied: the output is the input scaled, sample for sample (no delay, no loss).
    voiced = np.abs(audio) > 0.01
    gain = reply[voiced] / audio[voiced]
    assert gain.min() > 0 and gain.max() < 10 ** (MAX_GAIN_DB / 20)


def test_the_gain_moves_slowly_when_the_level_changes():
    """Replies 12 dB louder than the last: the AGC follows at its slew rate, no jump (no pumping),
    and within a reply or two (its 3 s time constant) they are at the target again."""
    level = OutputLevel(SPEAK_RATE, OutputConfig(loudness_lufs=-30.0, true_peak_dbtp=-1.0))  # far from the ceiling
    audio = speech()
    quiet, loud, louder_still = stream(level, audio * 0.25), stream(level, audio, seed=1), stream(level, audio, seed=2)
    voiced = np.abs(audio) > 0.05
    gain_db = 20 * np.log10(loud[voiced] / audio[voiced])
    where = np.flatnonzero(voiced) / SPEAK_RATE
    slope = np.abs(np.diff(gain_db)) / np.maximum(np.diff(where), 1 / SPEAK_RATE)
    assert slope[np.diff(where) > 0.01].max() <= MAX_SLEW_DB_PER_S * 1.01
    assert abs(integrated(quiet) + 30) <= 1.0
    assert integrated(loud[:SPEAK_RATE]) > -30 + 6  # louder at first: the gain has not jumped
    assert abs(integrated(louder_still) + 30) <= 1.0


def test_silence_stays_silent_and_hiss_is_not_boosted_past_the_gain_limit():
    level = OutputLevel(SPEAK_RATE, OutputConfig())
    assert not stream(level, np.zeros(SPEAK_RATE * 2, np.float32)).any()
    hiss = np.random.default_rng(0).normal(0, 10 ** (-60 / 20), SPEAK_RATE * 3).astype(np.float32)  # -60 dBFS
    out = stream(level, hiss)
    assert integrated(out) <= integrated(hiss) + MAX_GAIN_DB + 0.1


def test_no_target_leaves_the_level_and_still_limits_the_peaks():
    audio = speech() * 2.4  # sample peak 1.2: over full scale
    out = stream(OutputLevel(SPEAK_RATE, OutputConfig(loudness_lufs=None, true_peak_dbtp=-1.0)), audio)
    assert true_peak_dbtp(out) <= -1.0 + 0.1
    quiet = np.abs(audio) < 0.3  # far from the peaks the limiter leaves the audio alone... mostly
    assert np.median(np.abs(out[quiet] - audio[quiet])) < 1e-3


def test_peaks_between_samples_are_limited_where_the_samples_are_under_the_ceiling():
    """A tone at a quarter of the rate, 45 degrees off its samples: every sample is at 0.707 (-3 dBFS,
    under the -1 dBTP ceiling), the waveform between them peaks at 1.0 (0 dBTP). The limiter
    interpolates only near samples that could reach the ceiling: these must count as such."""
    k = np.arange(SPEAK_RATE * 2)
    tone = np.sin(2 * np.pi * k / 4 + np.pi / 4).astype(np.float32)
    assert np.abs(tone).max() < 10 ** (-1 / 20) and true_peak_dbtp(tone) > -0.1
    out = stream(OutputLevel(SPEAK_RATE, OutputConfig(loudness_lufs=None, true_peak_dbtp=-1.0)), tone)
    assert true_peak_dbtp(out) <= -1.0 + 0.1


def test_the_streaming_meter_reads_what_pyloudnorm_reads_on_a_steady_signal():
    """Hiss over a loud 20 Hz hum: the K-weighting's high shelf lifts the one, its high pass all
    but removes the other."""
    t = np.arange(SPEAK_RATE * 6) / SPEAK_RATE
    noise = np.random.default_rng(0).normal(0, 0.05, len(t)) + 0.3 * np.sin(2 * np.pi * 20 * t)
    meter = LoudnessMeter(SPEAK_RATE)
    for i in range(0, len(noise), 7001):  # chunks that do not line up with its 100 ms hops
        meter.feed(noise[i : i + 7001])
    assert abs(meter.lufs - integrated(noise)) <= 0.05


def test_the_config_defaults_are_a_streamers():
    config = OutputConfig()
    assert config.loudness_lufs == -16.0 and config.true_peak_dbtp == -1.0
    with pytest.raises(ValueError):
        OutputConfig(true_peak_dbtp=1.0)
