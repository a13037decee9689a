"""The Paraformer front end, streaming: fbank (kaldi-native-fbank) -> LFR stacking -> CMVN.

The same features as funasr 1.4.16's WavFrontendOnline (frontends/wav_frontend.py) fed the same
pieces: 25 ms Hamming frames every 10 ms over the stream's concatenated audio (the samples short of
a whole frame wait for the next piece), 80 log-mel bins of int16-scale samples, dither 0; then LFR:
each output frame stacks 7 fbank frames every 6 (60 ms), the stream's first fbank frame repeated 3
times in front; then CMVN from am.mvn, (x + shift) * scale. A piece emits every LFR frame whose 7
fbank frames are all there; the final piece pads the last window with copies of the last frame.

Per stream this holds under one fbank frame of samples and under one LFR window of fbank frames
(fewer than lfr_m + lfr_n rows of n_mels floats).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import kaldi_native_fbank as knf
import numpy as np


@dataclass(frozen=True)
class FrontendConfig:
    """config.yaml's frontend_conf."""

    fs: int = 16000
    n_mels: int = 80
    frame_length: int = 25  # ms
    frame_shift: int = 10  # ms
    lfr_m: int = 7
    lfr_n: int = 6
    window: str = "hamming"

    @property
    def frame_samples(self) -> int:
        return self.fs * self.frame_length // 1000

    @property
    def shift_samples(self) -> int:
        return self.fs * self.frame_shift // 1000

    @property
    def dim(self) -> int:
        return self.n_mels * self.lfr_m

    @property
    def lfr_samples(self) -> int:
        """Samples per LFR frame: 960 (60 ms) at 16 kHz with lfr_n 6."""
        return self.shift_samples * self.lfr_n


@dataclass(frozen=True)
class Cmvn:
    shift: np.ndarray  # (dim,) float32, added
    scale: np.ndarray  # (dim,) float32, then multiplied


def load_cmvn(path: str | Path) -> Cmvn:
    """am.mvn in Kaldi nnet1 text: <AddShift> then <Rescale>, each followed by a
    `<LearnRateCoef> 0 [ v1 v2 ... ]` line (funasr's load_cmvn reads the same two lines)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    found: dict[str, np.ndarray] = {}
    for i, line in enumerate(lines[:-1]):
        head = line.split()[:1]
        if head and head[0] in ("<AddShift>", "<Rescale>"):
            values = lines[i + 1].split()
            if values[:1] != ["<LearnRateCoef>"] or values[2] != "[" or values[-1] != "]":
                raise ValueError(f"{path}:{i + 2}: expected '<LearnRateCoef> x [ ... ]' after {head[0]}")
            found[head[0]] = np.array(values[3:-1], dtype=np.float32)
    if set(found) != {"<AddShift>", "<Rescale>"}:
        raise ValueError(f"{path}: needs both <AddShift> and <Rescale> (found {sorted(found)})")
    if found["<AddShift>"].shape != found["<Rescale>"].shape:
        raise ValueError(f"{path}: <AddShift> has {found['<AddShift>'].size} values, <Rescale> {found['<Rescale>'].size}")
    return Cmvn(found["<AddShift>"], found["<Rescale>"])


def fbank(samples: np.ndarray, config: FrontendConfig) -> np.ndarray:
    """Log-mel fbank (frames, n_mels) of float samples in [-1, 1], Kaldi's options as funasr sets them."""
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = float(config.fs)
    opts.frame_opts.frame_length_ms = float(config.frame_length)
    opts.frame_opts.frame_shift_ms = float(config.frame_shift)
    opts.frame_opts.dither = 0.0
    opts.frame_opts.snip_edges = True
    opts.frame_opts.window_type = config.window
    opts.mel_opts.num_bins = config.n_mels
    opts.energy_floor = 0.0
    computer = knf.OnlineFbank(opts)
    computer.accept_waveform(float(config.fs), (samples.astype(np.float32) * np.float32(1 << 15)))
    computer.input_finished()
    if not computer.num_frames_ready:
        return np.zeros((0, config.n_mels), np.float32)
    return np.stack([computer.get_frame(i) for i in range(computer.num_frames_ready)]).astype(np.float32)


class StreamFrontend:
    """One stream's front end: pieces of audio in, CMVN'd LFR frames (n, dim) out."""

    def __init__(self, config: FrontendConfig, cmvn: Cmvn | None) -> None:
        if cmvn is not None and cmvn.shift.size != config.dim:
            raise ValueError(f"am.mvn has {cmvn.shift.size} dims; the front end makes {config.dim}")
        self.config = config
        self.cmvn = cmvn
        self.samples = np.zeros(0, np.float32)  # short of one more fbank frame
        self.splice: np.ndarray | None = None  # fbank frames not yet in an emitted LFR frame

    def reset(self) -> None:
        self.samples = np.zeros(0, np.float32)
        self.splice = None

    def __call__(self, piece: np.ndarray, is_final: bool) -> np.ndarray:
        c = self.config
        audio = np.concatenate((self.samples, piece.astype(np.float32)))
        n_frames = (len(audio) - c.frame_samples) // c.shift_samples + 1 if len(audio) >= c.frame_samples else 0
        self.samples = audio[n_frames * c.shift_samples:]
        empty = np.zeros((0, c.dim), np.float32)
        if n_frames:
            frames = fbank(audio, c)
            if self.splice is None:  # the stream's first frame, repeated to centre the first window
                self.splice = np.repeat(frames[:1], (c.lfr_m - 1) // 2, axis=0)
            stacked = np.concatenate((self.splice, frames))
            if not is_final and len(stacked) < c.lfr_m:
                self.splice = stacked
                return empty
        elif is_final and self.splice is not None:
            stacked = self.splice
        else:
            return empty
        lfr, self.splice = self._lfr(stacked, is_final)
        if self.cmvn is not None:
            lfr = (lfr + self.cmvn.shift) * self.cmvn.scale
        return lfr.astype(np.float32)

    def _lfr(self, frames: np.ndarray, is_final: bool) -> tuple[np.ndarray, np.ndarray]:
        """Every complete LFR window of `frames` (all windows, padded, when final), and the frames
        the next piece's windows start with (funasr's apply_lfr)."""
        m, n = self.config.lfr_m, self.config.lfr_n
        t = len(frames)
        if is_final:
            count = max(0, math.ceil((t - (m - 1) // 2) / n))
        else:
            count = (t - m) // n + 1
        needed = (count - 1) * n + m if count else 0
        if needed > t:
            frames_padded = np.concatenate((frames, np.repeat(frames[-1:], needed - t, axis=0)))
        else:
            frames_padded = frames
        lfr = np.stack([frames_padded[i * n: i * n + m].reshape(-1) for i in range(count)]) if count else (
            np.zeros((0, m * frames.shape[1]), np.float32))
        rest = frames[min(t - 1, count * n):]
        return lfr, rest
