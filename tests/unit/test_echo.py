"""The echo canceller: the reply's own audio fed back into the input, with and without speech over it.

Each case prints the echo's attenuation (run with -s to read the figures): the reply is played
twice with a pause, as two replies of one session; attenuation is measured over the second one,
once AEC3 has converged, and over the first one for the record.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.echo import utterance_starts, utterances_begun
from tests.audio import espeak_speech
from voicebot.audio.echo import AEC3_FIELD_TRIALS, MAX_FAR_S, EchoCanceller
from voicebot.audio.endpoint import HELD_SILENCE_SHARE, WINDOW, WINDOW_MS
from voicebot.audio.resample import StreamResampler
from voicebot.config.stages import EndpointConfig
from voicebot.serving.silero import SileroVad

REPLY = "Here is a longer reply from the bot. It keeps talking for a few seconds, as replies do."
BARGE_IN = "Stop talking now please, I want to say something."
CHUNK_S = 0.2  # input arrives, and reply frames go out, 200 ms at a time


def db(x: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(np.asarray(x, np.float64) ** 2) + 1e-20))


@pytest.fixture(scope="module")
def reply_24k() -> np.ndarray:
    once = espeak_speech(REPLY, "en-us", 24000)
    return np.concatenate([once, np.zeros(12000, np.float32), once])  # two replies, 0.5 s apart


def room_tail(rt60_s: float, direct_over_tail_db: float) -> np.ndarray:
    """A room's impulse response: the direct path, then an exponentially decaying tail (fixed seed)."""
    n = round(rt60_s * 16000)
    tail = np.random.default_rng(1).standard_normal(n) * np.exp(-6.9 * np.arange(n) / n)
    tail[:48] = 0  # the first reflection 3 ms after the direct path
    tail *= np.sqrt(10 ** (-direct_over_tail_db / 10) / np.sum(tail**2))
    tail[0] = 1.0
    return tail.astype(np.float32)


def run_case(reply_24k: np.ndarray, delay_ms: int, gain_db: float | None, speech: np.ndarray | None,
             backlog_chunks: int = 0, speech_at_s: float | None = None, noise_dbfs: float | None = None,
             room: np.ndarray | None = None, suppressing: list[bool] | None = None):
    """Play the reply, feed it back `delay_ms` late at `gain_db` (None: no echo path at all), through
    `room`'s impulse response if given, plus `speech` over the second reply (or from `speech_at_s`
    into the first), plus a microphone's white noise floor at `noise_dbfs`. Returns the canceller,
    the echo, the speech, and both outputs: AEC3's suppressed one and the linear one; `suppressing`,
    if given, gets whether the canceller suppressed after each chunk, as the front end reads it.

    On a clock of its own: input chunk i arrives at (i + 1) * CHUNK_S, reply chunk m is sent (and
    starts playing) at m * CHUNK_S. With a backlog, the input is processed `backlog_chunks` late:
    by then the reply chunks of that much later have been sent.
    """
    resampler = StreamResampler(24000, 16000)
    far = np.concatenate([resampler.process(reply_24k), resampler.flush()])
    n = len(far) + 16000
    delay = delay_ms * 16
    echo = np.zeros(n, np.float32)
    if gain_db is not None:
        played = far if room is None else np.convolve(far, room)[: len(far)].astype(np.float32)
        echo[delay : delay + len(far)] = played[: n - delay] * 10 ** (gain_db / 20)
    voice = np.zeros(n, np.float32)
    if speech is not None:
        start = int(len(far) * 0.7) if speech_at_s is None else int(speech_at_s * 16000)
        voice[start : start + len(speech)] = speech[: n - start]
    canceller = EchoCanceller()
    near, out, linear = echo + voice, [], []
    if noise_dbfs is not None:
        near = near + np.random.default_rng(2).standard_normal(n).astype(np.float32) * 10 ** (noise_dbfs / 20)
    step = int(CHUNK_S * 16000)
    sent = 0
    for i in range(0, n, step):
        while sent <= i // step + backlog_chunks and sent * step * 3 // 2 < len(reply_24k):
            j = sent * step * 3 // 2
            canceller.play(reply_24k[j : j + step * 3 // 2], sent_at=sent * CHUNK_S)
            sent += 1
        cancelled = canceller.process(near[i : i + step], arrived=(i // step + 1) * CHUNK_S)
        out.append(cancelled.suppressed)
        linear.append(cancelled.linear)
        if suppressing is not None:
            suppressing.append(canceller.suppressing)
    out, linear = np.concatenate(out), np.concatenate(linear)
    return canceller, echo[: len(out)], voice[: len(out)], out, linear


@pytest.mark.parametrize("delay_ms", [50, 150, 300])
@pytest.mark.parametrize("gain_db", [-6, -20])
def test_echo_is_removed(reply_24k, delay_ms, gain_db):
    canceller, echo, _, out, _ = run_case(reply_24k, delay_ms, gain_db, None)
    half = len(out) // 2
    first, second = db(echo[:half]) - db(out[:half]), db(echo[half:]) - db(out[half:])
    print(f"\necho {delay_ms} ms {gain_db} dB: attenuation {first:.1f} dB (first reply), {second:.1f} dB (second); "
          f"delay estimate {canceller.delay_ms} ms")
    assert second >= 20, f"only {second:.1f} dB of echo removed once converged"
    assert first >= 6, f"only {first:.1f} dB of echo removed during the first reply"
    assert canceller.delay_ms is not None and abs(canceller.delay_ms - delay_ms) <= 10
    assert canceller.tracker.echo_confirmed and not canceller.tracker.echo_absent


def test_input_waiting_to_be_processed_does_not_shift_the_echo(reply_24k):
    # A loaded server processes input late; the reply sent meanwhile is matched with the input of
    # when it was sent, so the canceller still sees the 300 ms path, not 300 ms plus the wait.
    canceller, echo, _, out, _ = run_case(reply_24k, 300, -10, None, backlog_chunks=2)
    half = len(out) // 2
    first, second = db(echo[:half]) - db(out[:half]), db(echo[half:]) - db(out[half:])
    print(f"\necho 300 ms behind 400 ms of unprocessed input: attenuation {first:.1f} dB (first reply), {second:.1f} dB (second)")
    assert first >= 20 and second >= 20
    assert abs(canceller.delay_ms - 300) <= 10


@pytest.mark.parametrize("delay_ms", [50, 300])
@pytest.mark.parametrize("gain_db", [-6, -20])
def test_speech_over_the_echo_is_kept(reply_24k, delay_ms, gain_db):
    speech = espeak_speech(BARGE_IN, "en-gb") * 0.7
    _, echo, voice, out, _ = run_case(reply_24k, delay_ms, gain_db, speech)
    talking = voice != 0
    kept = db(out[talking]) - db(voice[talking])
    # The output may run a few ms behind the input (AEC3's own block delay): align before comparing.
    lag = max(range(0, 480, 16), key=lambda k: float(np.dot(out[k:], voice[: len(voice) - k])))
    similarity = np.corrcoef(out[lag:][talking[: len(out) - lag]], voice[: len(voice) - lag][talking[: len(out) - lag]])[0, 1]
    echo_only = (voice == 0) & (echo != 0) & (np.arange(len(out)) > len(out) // 2)
    print(f"\nspeech over echo {delay_ms} ms {gain_db} dB: speech energy kept {kept:+.1f} dB, "
          f"correlation {similarity:.2f}, echo attenuation {db(echo[echo_only]) - db(out[echo_only]):.1f} dB")
    assert kept >= -3, f"the speech over the echo lost {-kept:.1f} dB"
    assert similarity >= 0.7


def barge_in_heard_ms(audio: np.ndarray, start: int, barge_in_min_ms: int = 300) -> float | None:
    """When, from `start`, Silero has heard `barge_in_min_ms` of speech in a row: the barge-in rule."""
    probabilities = SileroVad().probabilities(audio[: len(audio) // WINDOW * WINDOW].reshape(-1, WINDOW))
    run = 0
    for k, probability in enumerate(probabilities):
        run = run + WINDOW_MS if probability >= 0.5 else 0
        if run >= barge_in_min_ms and (k + 1) * WINDOW > start:
            return ((k + 1) * WINDOW - start) / 16
    return None


def test_speech_over_a_reply_with_no_echo_path_is_kept(reply_24k):
    # Headphones, or an OBS mix without desktop audio: the reply never comes back. AEC3's linear
    # filter has nothing to converge on, and its suppressor, taking the echo to be as loud as the
    # reply, removed 20-65 dB of the user's speech: barge-in took ~2 s instead of ~0.5 s.
    speech = espeak_speech(BARGE_IN, "en-gb") * 0.7
    speech_at_s = 2.0  # into the first reply, the canceller cold: bench/echo.py's barge-in
    canceller, _, voice, out, _ = run_case(reply_24k, 0, None, speech, speech_at_s=speech_at_s)
    start = int(speech_at_s * 16000)
    kept = []
    for w in range(0, 16000, 3200):  # each 200 ms frame of the first second of speech
        talking = voice[start + w : start + w + 3200] != 0
        kept.append(db(out[start + w : start + w + 3200][talking]) - db(voice[start + w : start + w + 3200][talking]))
    heard, heard_raw = barge_in_heard_ms(out, start), barge_in_heard_ms(voice, start)
    print(f"\nspeech over a reply, no echo: kept per 200 ms {' '.join(f'{k:+.1f}' for k in kept)} dB; "
          f"barge-in heard after {heard} ms ({heard_raw} ms with no canceller)")
    # The barge-in rule needs Silero to hear every window of 300 ms in a row: a frame that lost
    # more than the 3 dB the test above allows is where it started missing them.
    assert min(kept) >= -3, f"speech over the reply lost {-min(kept):.1f} dB in a 200 ms frame"
    assert heard is not None and heard <= heard_raw + 200, "the barge-in was heard more than a frame late"
    assert canceller.tracker.echo_absent and not canceller.tracker.echo_confirmed  # the voice is no echo


@pytest.mark.parametrize("speech_at_s", [pytest.param(0.3, marks=pytest.mark.xfail(strict=True, reason=(
    "issue 29, open: words that start within ~0.35 s of the reply's first sound are AEC3's until the early windows "
    "find no echo (-216 and -65 dB in their first 400 ms, barge-in after 1332 ms instead of 436): an echo of a "
    "path from there to AEC3_REACH_S could still come after them. Passing them after their first ONSET_QUICK_S, the "
    "onset window deciding once the reply has played AEC3_REACH_S, kept them (436 ms), but an echo of 350-550 ms under "
    "a short word ('Stop.', no barge-in alone) then passed after it and barged in (8 of 12 echoes, was 4, all 550 ms); "
    "the input since each possible delay against the far end (words 0.72 at most, a -6 dB echo under them 0.45-0.98) "
    "or its last 0.1 s (words up to 0.99, an echo in a room 0.5-1.2 s to reach 0.9) does not tell them apart. GCC-PHAT "
    "on two disjoint 0.15 s windows at one path finds the echo 0.08 s before to 0.27 s after the word ends (no "
    "words over no echo taken for one, 72 cases), still too late: the same 8 barge-ins, and after a 50 ms click "
    "the echo passed for up to ~0.3 s (3-9 dB down over the next second, was 8-64)"))),
    0.5, 1.0])
def test_speech_early_in_a_reply_with_no_echo_path_is_kept(reply_24k, speech_at_s):
    # As above, but the user talks early into the first reply: no silent second comes first. With
    # silence as the only proof of no echo, AEC3's suppressor took 27-68 dB off each 200 ms of the
    # words 0.5 s in (issue 29: on /obs/audio speech.started 1.2-1.6 s late, no barge-in). The
    # reply played over AEC3_REACH_S with nothing back: there is no echo AEC3 could cancel. At 0.5 s,
    # short of it, the words' first 200 ms were AEC3's until ONSET_WINDOW_S of them was checked (-49 dB,
    # barge-in after 716 ms instead of 364): now the input itself from their first block, AEC3's again
    # if the far end explains their first ONSET_QUICK_S (echo_delay.py).
    speech = espeak_speech(BARGE_IN, "en-gb") * 0.7
    canceller, _, voice, out, _ = run_case(reply_24k, 0, None, speech, speech_at_s=speech_at_s)
    start = int(speech_at_s * 16000)
    kept = []
    for w in range(0, 16000, 3200):
        talking = voice[start + w : start + w + 3200] != 0
        kept.append(db(out[start + w : start + w + 3200][talking]) - db(voice[start + w : start + w + 3200][talking]))
    heard, heard_raw = barge_in_heard_ms(out, start), barge_in_heard_ms(voice, start)
    print(f"\nspeech {speech_at_s} s into a reply, no echo: kept per 200 ms {' '.join(f'{k:+.1f}' for k in kept)} dB; "
          f"barge-in heard after {heard} ms ({heard_raw} ms with no canceller)")
    assert min(kept) >= -3, f"speech over the reply lost {-min(kept):.1f} dB in a 200 ms frame"
    assert heard is not None and heard <= heard_raw + 200, "the barge-in was heard more than a frame late"


@pytest.mark.parametrize("noise_dbfs", [-70, -60])
def test_speech_over_a_reply_with_no_echo_path_and_a_noise_floor_is_kept(reply_24k, noise_dbfs):
    # A real microphone is never under -80 dBFS: the silent second never came, and AEC3's suppressor
    # took 11-38 dB off each 200 ms of words 1.5 s into the first reply over a -70 dBFS floor.
    speech = espeak_speech(BARGE_IN, "en-gb") * 0.7
    speech_at_s = 2.0
    canceller, _, voice, out, _ = run_case(reply_24k, 0, None, speech, speech_at_s=speech_at_s, noise_dbfs=noise_dbfs)
    start = int(speech_at_s * 16000)
    kept = kept_per_frame(out, voice, start)
    heard, heard_raw = barge_in_heard_ms(out, start), barge_in_heard_ms(voice, start)
    print(f"\nspeech over a reply, no echo, {noise_dbfs} dBFS noise: kept per 200 ms "
          f"{' '.join(f'{k:+.1f}' for k in kept)} dB; barge-in heard after {heard} ms ({heard_raw} ms with no canceller)")
    assert min(kept) >= -3, f"speech over the reply lost {-min(kept):.1f} dB in a 200 ms frame"
    assert heard is not None and heard <= heard_raw + 200, "the barge-in was heard more than a frame late"
    assert canceller.tracker.echo_absent


@pytest.mark.parametrize("delay_ms, gain_db, room", [(150, -6, None), (300, -20, None), (50, -6, (0.4, 0.0))])
@pytest.mark.parametrize("noise_dbfs", [None, -65])
def test_an_echo_with_a_user_talking_early_is_still_cancelled(reply_24k, delay_ms, gain_db, room, noise_dbfs):
    # The no-echo decisions above must not take a real echo for none: the echo alone (no voice) is
    # never heard as a barge-in, and a user talking 0.5 s into the first reply, before the echo is
    # confirmed, still is. Rooms: a pure delay (an OBS mix), and a tail as loud as the direct path.
    # (One with RT60 0.8 s and the tail 6 dB louder barged in from the echo alone with or without
    # these decisions: AEC3 itself leaves too much of it.)
    tail = None if room is None else room_tail(*room)
    canceller, echo, _, alone, _ = run_case(reply_24k, delay_ms, gain_db, None, noise_dbfs=noise_dbfs, room=tail)
    assert barge_in_heard_ms(alone, 0) is None, "the echo alone was heard as a barge-in"
    assert not canceller.tracker.echo_absent
    speech = espeak_speech(BARGE_IN, "en-gb") * 0.7
    speech_at_s = 0.5
    start = int(speech_at_s * 16000)
    _, _, voice, out, _ = run_case(reply_24k, delay_ms, gain_db, speech, speech_at_s=speech_at_s, noise_dbfs=noise_dbfs, room=tail)
    heard, heard_raw = barge_in_heard_ms(out, start), barge_in_heard_ms(voice, start)
    print(f"\necho {delay_ms} ms {gain_db} dB room {room} noise {noise_dbfs}: echo alone {db(echo) - db(alone):.1f} dB down, "
          f"never a barge-in; a user 0.5 s in heard after {heard} ms ({heard_raw} ms with no echo, no canceller)")
    assert heard is not None and heard <= heard_raw + 1000


def test_no_echo_path_leaves_the_input_alone(reply_24k):
    speech = espeak_speech(BARGE_IN, "en-gb") * 0.7
    canceller = EchoCanceller()
    out = np.concatenate([canceller.process(speech[i : i + 3200]).suppressed for i in range(0, len(speech), 3200)])
    kept = db(out) - db(speech[: len(out)])
    assert abs(kept) <= 1, f"with the bot silent the input changed by {kept:+.1f} dB"


def test_far_end_is_bounded_and_cut_on_barge_in(reply_24k):
    canceller = EchoCanceller()
    for i in range(0, len(reply_24k), 4800):  # sent, never matched with input
        canceller.play(reply_24k[i : i + 4800])
    assert canceller.far_dropped_samples > 0  # more than MAX_FAR_S waiting: the oldest went, counted
    assert canceller.far_pending_s <= MAX_FAR_S
    canceller.stop()
    assert canceller.far_pending_s == 0
    assert [len(out) for out in canceller.process(np.zeros(1600, np.float32))] == [1600, 1600]


@pytest.mark.parametrize("delay_ms", [326, 400, 500])
def test_an_echo_path_aec3_reaches_is_never_shifted(reply_24k, delay_ms):
    # bench/echo.py's 300 ms room measured 304-348 ms live. Once the tracker confirmed it (~3 s in),
    # holding the far end back by the estimate less HOLD_MARGIN_S moved AEC3's reference by 76-250 ms:
    # AEC3, cancelling 40 dB until then, re-converged, the echo leaked and barged in at ~3.7 s.
    # Its onset comes after the input was quiet over most of AEC3's reach: the input itself passes until
    # the far end explains its first ONSET_QUICK_S (echo_delay.py), AEC3's from there.
    canceller, echo, _, out, _ = run_case(reply_24k, delay_ms, -6, None)
    assert canceller.delay_ms is not None and abs(canceller.delay_ms - delay_ms) <= 10
    assert barge_in_heard_ms(out, 0) is None, "the echo alone was heard as a barge-in"
    half = len(out) // 2
    assert db(echo[:half]) - db(out[:half]) >= 20
    onset = slice(delay_ms * 16, delay_ms * 16 + 1600)
    assert db(echo[onset]) - db(out[onset]) >= 20, "the echo's first 100 ms passed as if there were none"


def test_an_echo_path_beyond_aec3s_reach_is_held_into_it(reply_24k):
    # An OBS mix with buffering: AEC3 alone cancels 10 dB of a 700 ms path; the tracker's hold
    # brings it within reach for the second reply. (The first reply, before the path is confirmed,
    # still leaks: see AEC3_REACH_S.)
    canceller, echo, _, out, _ = run_case(reply_24k, 700, -6, None)
    half = len(out) // 2
    assert abs(canceller.delay_ms - 700) <= 10
    assert db(echo[half:]) - db(out[half:]) >= 20


def test_aec3_runs_with_a_short_initial_state():
    # Its default 2.5 s "initial state" suppresses a user talking over a new reply's echo: live,
    # barge-in came up to 1.7 s later than with no echo (bench/echo.py). The field trial is
    # process-wide and read when an AEC3 is made; a WebRTC that dropped it would ignore it silently.
    import ctypes

    from aec_audio_processing import lib

    EchoCanceller()
    in_force = lib._ZN6webrtc11field_trial19GetFieldTrialStringEv
    in_force.restype = ctypes.c_char_p
    assert AEC3_FIELD_TRIALS in in_force()
    assert b"WebRTC-Aec3UseDot6SecondsInitialStateDuration/Enabled/" in AEC3_FIELD_TRIALS


def kept_per_frame(out: np.ndarray, voice: np.ndarray, start: int, lag: int = 0) -> list[float]:
    """The speech's gain in `out` (`lag` samples late) in each 200 ms frame of its first second, in
    dB: its projection on the speech, so echo left in `out` is no part of it."""
    gains = []
    for w in range(start, start + 16000, 3200):
        said, heard = voice[w : w + 3200], out[w + lag : w + lag + 3200]
        gains.append(20 * np.log10(max(float(np.dot(heard, said)), 1e-12) / float(np.dot(said, said))))
    return gains


@pytest.mark.parametrize("delay_ms, residual_db", [(150, 10), (300, 5)])
def test_the_recognizer_hears_the_words_spoken_over_a_new_replys_echo(reply_24k, delay_ms, residual_db):
    # AEC3's suppressor took 5-27 dB off each 100 ms of the first 0.6-0.9 s of words spoken over a
    # new reply's echo, and pocketsphinx made '' of them. The linear output keeps them, at the
    # input's sample positions, and leaves some echo (why the VAD, so barge-in, gets the other).
    speech = espeak_speech(BARGE_IN, "en-gb") * 0.7
    start = int(1.5 * 16000)  # into the first reply: both cancellers cold
    canceller, echo, voice, suppressed, linear = run_case(reply_24k, delay_ms, -6, speech, speech_at_s=start / 16000)
    spoken = slice(start, start + 16000)

    def best_lag(out: np.ndarray) -> int:
        return max(range(0, 480, 16), key=lambda k: float(np.dot(out[start + k : start + k + 16000], voice[spoken])))

    linear_kept = kept_per_frame(linear, voice, start)
    suppressed_kept = kept_per_frame(suppressed, voice, start, best_lag(suppressed))
    echo_only = (voice == 0) & (echo != 0) & (np.arange(len(linear)) > len(linear) // 2)
    residual = db(echo[echo_only]) - db(linear[echo_only])
    print(f"\nspeech over a new reply's echo {delay_ms} ms -6 dB, kept per 200 ms: linear "
          f"{' '.join(f'{k:+.1f}' for k in linear_kept)} dB, suppressed {' '.join(f'{k:+.1f}' for k in suppressed_kept)} dB; "
          f"echo under the linear output, second reply: {residual:.1f} dB down (suppressed: "
          f"{db(echo[echo_only]) - db(suppressed[echo_only]):.1f})")
    assert best_lag(linear) == 0, "the linear output is not at the input's sample positions"
    assert min(linear_kept) >= -6, f"the linear output lost {-min(linear_kept):.1f} dB of the words in a 200 ms frame"
    assert min(suppressed_kept) < min(linear_kept) - 3  # what it is for: the suppressor takes the words
    assert residual >= residual_db, f"the linear canceller took only {residual:.1f} dB off the converged echo"
    assert abs(canceller.delay_ms - delay_ms) <= 10


def test_without_libspeexdsp_the_recognizer_hears_the_suppressed_output(reply_24k, monkeypatch):
    # A host without the system library: sessions still cancel echo (AEC3), the recognizer gets AEC3's
    # output as before, and the server can say why (start-up log, /readyz's echo.problem).
    from voicebot.audio import linear_echo

    monkeypatch.setattr(linear_echo, "_speexdsp", lambda: None)
    assert linear_echo.linear_canceller_problem() == linear_echo.SPEEXDSP_MISSING
    with pytest.raises(RuntimeError, match="libspeexdsp1"):
        linear_echo.LinearCanceller()
    canceller = EchoCanceller(reply_rate=24000)
    canceller.play(reply_24k[:24000], sent_at=0.0)
    near = StreamResampler(24000, 16000).process(reply_24k[:24000]) * 0.5
    out = canceller.process(near, arrived=1.0)
    assert len(out.linear) > 0 and np.array_equal(out.linear, out.suppressed)


def linear_echo_reduction_db(echo: np.ndarray, linear: np.ndarray, from_s: float, to_s: float) -> float:
    span = slice(round(from_s * 16000), round(to_s * 16000))
    return db(echo[span]) - db(linear[span])


@pytest.mark.parametrize("gain_db", [-6, -20])
def test_the_linear_canceller_holds_a_new_replys_path_within_its_first_second(reply_24k, gain_db):
    # A barge-in 2 s into a first reply: with the tracker's delay (~3 s in) the 300 ms path stayed
    # beyond the linear filter, 0.0 dB of echo off 1.5-2.5 s into the reply, and the recognizer heard
    # the echo under the words. The early estimate places the path in the filter within ~1 s.
    canceller, echo, _, _, linear = run_case(reply_24k, 300, gain_db, None)
    reduction = linear_echo_reduction_db(echo, linear, 1.5, 2.5)
    print(f"\nlinear output, 300 ms {gain_db} dB, 1.5-2.5 s into the first reply: echo {reduction:.1f} dB down")
    assert canceller.tracker.early_delay_s is not None and abs(canceller.tracker.early_delay_s - 0.3) <= 0.01
    assert reduction >= 5, f"the linear canceller took only {reduction:.1f} dB off a new reply's echo"


@pytest.mark.parametrize("delay_ms, gain_db", [(150, -6), (300, -20)])
def test_a_second_reply_starts_where_the_first_left_the_linear_filter(reply_24k, delay_ms, gain_db):
    # A show: the first reply cut by a barge-in (stop()), the next one a second later. What MDF learnt
    # of the room over the first must hold from the second's first word.
    resampler = StreamResampler(24000, 16000)
    far = np.concatenate([resampler.process(reply_24k), resampler.flush()])
    step, cut_s, second_s = int(CHUNK_S * 16000), 2.6, 3.6  # the first reply cut at 2.6 s, the next sent at 3.6 s
    played = np.zeros(int(second_s * 16000) + len(far) // 2, np.float32)
    played[: int(cut_s * 16000)] = far[: int(cut_s * 16000)]
    played[int(second_s * 16000) :] = far[: len(played) - int(second_s * 16000)]
    echo = np.zeros_like(played)
    echo[delay_ms * 16 :] = played[: len(played) - delay_ms * 16] * 10 ** (gain_db / 20)
    canceller, linear = EchoCanceller(), []
    for i in range(0, len(played) - step + 1, step):
        t = i / 16000
        if abs(t - cut_s) < CHUNK_S / 2:
            canceller.stop()
        if t < cut_s or t >= second_s:
            j = round((t if t < cut_s else t - second_s) * 24000)
            canceller.play(reply_24k[j : j + step * 3 // 2], sent_at=t)
        linear.append(canceller.process(echo[i : i + step], arrived=t + CHUNK_S).linear)
    linear = np.concatenate(linear)
    delay_s = delay_ms / 1000
    # Each reply's first half second of echo, and the first's last before the cut.
    first = linear_echo_reduction_db(echo, linear, delay_s, delay_s + 0.5)
    at_cut = linear_echo_reduction_db(echo, linear, cut_s - 0.5, cut_s)
    second = linear_echo_reduction_db(echo, linear, second_s + delay_s, second_s + delay_s + 0.5)
    print(f"\nlinear output, {delay_ms} ms {gain_db} dB: echo down {first:.1f} dB over the first reply's first half second, "
          f"{at_cut:.1f} over its last before the cut, {second:.1f} over the second reply's first")
    assert second >= at_cut - 3 and second >= first + 6, "the second reply started from a filter that forgot the room"


@pytest.mark.parametrize("speech_at_s", [1.0, 1.5, 2.0])
def test_a_voice_over_a_new_reply_leaves_the_linear_hold_where_the_echo_put_it(reply_24k, monkeypatch, speech_at_s):
    # Under a barge-in GCC-PHAT can peak at a chance lag of the voice: the tracker's first median
    # (one estimate) read a 150 ms path as 80 ms, and two overlapping early windows agreed on 0.53 s
    # for a 50 ms one. Each moved the linear hold, and MDF started again under the words.
    from voicebot.audio.linear_echo import LinearCanceller

    resets = []
    monkeypatch.setattr(LinearCanceller, "reset", lambda self: resets.append(self))
    speech = espeak_speech(BARGE_IN, "en-gb") * 0.7
    canceller, *_ = run_case(reply_24k, 150, -20, speech, speech_at_s=speech_at_s)
    assert abs(canceller.tracker.early_delay_s - 0.15) <= 0.01
    assert len(resets) == 1, f"the linear hold moved {len(resets)} times (once: onto the 150 ms path)"


# AEC3's suppressor, in double talk over a new reply's echo as loud as the words, takes whole syllables
# of them to its floor: where the echo's own syllables fall under the words' first ones, nothing of those
# rises for EchoOnset, and where it takes 0.3 s or more from inside the words, EchoOnset's reach stopped
# at that hole (ECHO_GAP_MS; now bridged, below). Which delays that happens at depends on where the reply's syllables fall
# under the words (the same 180 ms path 2.0 and 2.5 s into the reply loses 10 and 5 dB of them, not 28),
# not on the delay itself: AEC3's reference aligned by hand (the path inside its filter from the first
# block) lost as much (23-28 dB at 180 ms); its double-talk settings (field trials: dominant near-end
# detection at 0.5 and 0.75, transparent or rapidly adjusting suppressor tunings) left the 180 ms case as
# it is; no initial state at all, which kept it, let the echo alone barge in (4 of 12 at 50 ms -6 dB,
# bench/echo.py --offline); a short reverb assumed (UseLowLateReflectionsDefaultGain) kept 180 and 240
# but reached 0.48 s back over the 60 ms path's echo, and the bench's 300 ms -6 dB row heard 9 fewer of
# the words from EchoOnset's start (150 ms -6 dB: 8 more; no more echo barge-ins, in rooms either).
# Where it lets the first word through and takes the next ~0.45 s, the second word with it (240 ms), EchoOnset
# bridges that hole back to the first word (ECHO_HOLE_MS, echo_onset.py: it stopped there, 0.55 s into the words).
# The words' first 0.3 s over the 180 ms path are no more evidence in the linear output (-20 to -43 dBFS per 32 ms
# window against the echo alone's -19 to -46) nor in the input's correlation with the far end at the path (0.56-0.97
# against 0.97-1.00 on this pure delay, and 0.67-0.95 for an echo alone in a room).
SUPPRESSOR_TAKES_THE_FIRST_WORDS = pytest.mark.xfail(strict=True, reason=(
    "issue 29, open: AEC3's suppressor takes the words' first ~0.3 s down to its floor, where it leaves the echo alone "
    "(3-9 dB over it, the echo alone 2-6 and 13 once; the linear output keeps them), so nothing of them rises over it "
    "for EchoOnset: the utterance starts 0.16 s into the words"))


@pytest.mark.parametrize("delay_ms", [60, 120, 150, pytest.param(180, marks=SUPPRESSOR_TAKES_THE_FIRST_WORDS), 205, 230, 240, 260])
def test_words_over_a_first_replys_echo_start_the_utterance_on_time(delay_ms):
    # test_turn_taking's echo case offline, deterministically: its reply, at the level the server's
    # espeak speaks it (peak ~0.9, where espeak_speech normalises to 0.5), its -6 dB echo, and the
    # words 1.5 s into the first reply. The live test's echo came back 134-233 ms late (the client's
    # timing); the server's reply, synthesized in-process, differs a little from run to run. At 205 ms
    # AEC3's suppressor took the first words off the output the VAD hears, and the endpoint rule alone
    # started the utterance 0.52 s into them (issue 29: test_speech_over_the_bots_echo_is_transcribed's
    # ''); EchoOnset reaches back to them.
    reply = espeak_speech("Here is a long answer that goes on for a while, about the weather and the show and "
                          "everything else you might want to know.", "en", 24000) * 1.75
    reply_24k = np.concatenate([reply, np.zeros(12000, np.float32), reply])
    words = espeak_speech("what time does the show start tomorrow") * 0.7
    speech_at_s = 1.5
    suppressing: list[bool] = []
    _, _, _, suppressed, linear = run_case(reply_24k, delay_ms, -6, words, speech_at_s=speech_at_s, suppressing=suppressing)
    starts = utterance_starts(suppressed, linear, suppressing, int(CHUNK_S * 16000))
    start = None if starts is None else starts[1] / 16000  # EchoOnset's: where the recognizer's audio begins
    print(f"\nwords {speech_at_s} s into a first reply over a {delay_ms} ms -6 dB echo: the utterance starts "
          f"{None if start is None else round(start - speech_at_s, 2)} s after them (the endpoint rule alone: "
          f"{None if starts is None else round(starts[0] / 16000 - speech_at_s, 2)} s)")
    assert start is not None and start <= speech_at_s + 0.1, "the recognizer's audio misses the first words"
    # ... and no further back than the words need: the pre-roll and a window or two of the echo's residual.
    assert start >= speech_at_s - EndpointConfig().pre_speech_ms / 1000 - 0.15


@pytest.mark.parametrize("speech_at_s", [1.25, 2.0])
@pytest.mark.parametrize("delay_ms", [120, 180, 240, 300])
def test_words_over_a_first_replys_echo_are_one_utterance(delay_ms, speech_at_s):
    # test_turn_taking's "speech over the bot's echo is transcribed" failed in 0 of 12 runs alone, 3 of 35 beside
    # one or two busy processes, with three finals: the question, then '' and '' for the words, cut in two.
    # Its input, captured and run again through a canceller here, was a pure 215 ms (154 ms) delay and
    # did the same offline: AEC3's suppressor took 0.5 s from inside the words (240 and 300 ms, 1.25 s
    # in, here), and the endpoint rule, which hears its output, ended the utterance there. The windows
    # the suppressor hid are not the user's silence (EchoOnset, Endpointer): one utterance, which ends
    # at most HELD_SILENCE_SHARE of endpoint_silence_ms later than its silence alone would have ended it.
    reply = espeak_speech("Here is a long answer that goes on for a while, about the weather and the show and "
                          "everything else you might want to know.", "en", 24000) * 1.75
    reply_24k = np.concatenate([reply, np.zeros(12000, np.float32), reply])
    words = espeak_speech("what time does the show start tomorrow") * 0.7
    suppressing: list[bool] = []
    _, _, _, suppressed, linear = run_case(reply_24k, delay_ms, -6, words, speech_at_s=speech_at_s, suppressing=suppressing)
    at = round(speech_at_s * 16000)
    begun, late_ms = utterances_begun(suppressed, linear, suppressing, int(CHUNK_S * 16000), at, at + len(words) + 4800)
    print(f"\nwords {speech_at_s} s into a first reply over a {delay_ms} ms -6 dB echo: {begun} utterances, "
          f"ended {late_ms} ms late (the suppressor's windows held)")
    assert begun == 1
    assert len(late_ms) == 1 and late_ms[0] <= EndpointConfig().endpoint_silence_ms * HELD_SILENCE_SHARE  # it ended, bounded
