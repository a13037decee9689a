"""Streams of audio in, tokens out: funasr's streaming loop around our batched model.

A stream takes audio of any length; like funasr's `ParaformerStreaming.inference` it cuts it into
pieces of one chunk stride (chunk_size[1] * 960 samples, 600 ms for [0, 10, 5]) and keeps the
remainder (under one stride) for the next call. `is_final` flushes: the remainder becomes a last,
shorter piece (under 960 samples it is funasr's "tail chunk", which re-runs the kept overlap
frames), the CIF adds its tail weight so a half-integrated token still fires, and afterwards the
stream starts a new utterance with fresh state.

`StreamingParaformer.step` runs one piece of each of several streams as one model call; `feed`
runs one stream's pieces one after another (batch 1, the reference the batch must equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from voicebot.asr.sanm.frontend import StreamFrontend
from voicebot.asr.sanm.loader import LoadedParaformer
from voicebot.asr.sanm.model import ChunkConfig, ChunkOutput, StreamState

# Tokens never part of the text (funasr's sentence_postprocess drops them too).
UNSPOKEN = frozenset({"<s>", "</s>", "<unk>", "<OOV>", "<blank>"})


@dataclass
class Piece:
    """One decode step's input for one stream."""

    feats: torch.Tensor | None  # (n, F) LFR frames; None: funasr's tail chunk (final piece < 960 samples)
    final: bool


@dataclass
class Decoded:
    """What one call gave a stream: the newly emitted tokens (deltas, never revised)."""

    tokens: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    steps: list[ChunkOutput] = field(default_factory=list)  # per decode step, for tests and fixtures

    @property
    def text(self) -> str:
        return tokens_to_text(self.tokens)

    @property
    def confidences(self) -> list[float]:
        return [math.exp(p) for p in self.token_logprobs]

    def extend(self, other: Decoded) -> None:
        self.tokens += other.tokens
        self.token_ids += other.token_ids
        self.token_logprobs += other.token_logprobs
        self.steps += other.steps


def tokens_to_text(tokens: list[str]) -> str:
    """Join tokens as funasr does: CJK characters without spaces, "@@"-continued word pieces
    glued, whole latin words separated by one space (and none before a CJK character)."""
    out: list[str] = []
    word = ""
    for token in tokens:
        if token in UNSPOKEN:
            continue
        if token.endswith("@@"):
            word += token[:-2]
        elif token.isascii() and (token.replace("'", "").isalpha()):
            out += [word + token, " "]
            word = ""
        else:
            if out and out[-1] == " ":
                out.pop()
            out.append(word + token)
            word = ""
    return "".join(out).strip()


class ParaformerStream:
    """One session's recognition state: front end, unconsumed samples and the model's state."""

    def __init__(self, engine: StreamingParaformer) -> None:
        self.engine = engine
        self.frontend = StreamFrontend(engine.loaded.frontend, engine.loaded.cmvn)
        self.samples = np.zeros(0, np.float32)  # under one stride, waiting for the rest
        self.state: StreamState = engine.model.new_state(engine.chunk)

    def pieces(self, audio: np.ndarray, is_final: bool) -> list[Piece]:
        """Cut the stream's audio into decode steps and compute their features (funasr's inference loop)."""
        stride = self.engine.stride_samples
        lfr_samples = self.engine.loaded.frontend.lfr_samples
        audio = np.concatenate((self.samples, np.asarray(audio, np.float32).reshape(-1)))
        count = len(audio) // stride + int(is_final)
        pieces = []
        for i in range(count):
            piece = audio[i * stride:(i + 1) * stride]
            final = is_final and i == count - 1
            if final and len(piece) < lfr_samples:
                pieces.append(Piece(None, True))
            else:
                feats = torch.from_numpy(self.frontend(piece, final))
                pieces.append(Piece(feats.to(self.engine.device, self.engine.dtype), final))
        self.samples = np.zeros(0, np.float32) if is_final else audio[count * stride:]
        if is_final:
            self.frontend.reset()
        return pieces

    def reset(self) -> None:
        """Drop the utterance without flushing it."""
        self.samples = np.zeros(0, np.float32)
        self.frontend.reset()
        self.state = self.engine.model.new_state(self.engine.chunk)

    def state_bytes(self) -> int:
        return self.samples.nbytes + self.state.nbytes() + (self.frontend.splice.nbytes if self.frontend.splice is not None else 0)

    @property
    def nbytes(self) -> int:
        """state_bytes, under the name voicebot.asr.funasr_model.state_bytes reads."""
        return self.state_bytes()


class StreamingParaformer:
    """A loaded model plus the streaming geometry every stream of it shares."""

    def __init__(self, loaded: LoadedParaformer, chunk: ChunkConfig) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.chunk = chunk
        self.stride_samples = chunk.stride_frames * loaded.frontend.lfr_samples
        parameter = next(self.model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    def open(self) -> ParaformerStream:
        return ParaformerStream(self)

    def step(self, work: list[tuple[ParaformerStream, Piece]]) -> list[Decoded]:
        """One piece of each stream (each stream at most once) through one model call."""
        if len({id(stream) for stream, _ in work}) != len(work):
            raise ValueError("a stream's pieces are sequential: one piece per stream per step")
        outputs = self.model.step([p.feats for _, p in work], [p.final for _, p in work],
                                  [s.state for s, _ in work], self.chunk)
        results = []
        for (stream, piece), out in zip(work, outputs):
            tokens = [self.loaded.tokens[i] for i in out.token_ids]
            results.append(Decoded(tokens, list(out.token_ids), list(out.token_logprobs), [out]))
            if piece.final:  # funasr re-initialises the cache after a final call
                stream.state = self.model.new_state(self.chunk)
        return results

    def feed(self, stream: ParaformerStream, audio: np.ndarray, is_final: bool) -> Decoded:
        """Batch 1: all of one call's pieces, in order."""
        result = Decoded()
        for piece in stream.pieces(audio, is_final):
            result.extend(self.step([(stream, piece)])[0])
        return result
