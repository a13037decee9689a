"""One reply's streaming state in token2wav.py's Token2Wav (its module doc says how streams are
driven and rendered): the voice prompt it speaks in (`FlowPrompt`), the official chunk schedule
(`StreamSchedule`), the speed mode, the stream itself (`Token2WavStream`) and the chunk it asks a
render for (`ChunkRequest`)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Literal, Protocol

import torch
from torch import Tensor

from voicebot.tts.cosyvoice2.chunk_vocoder import ChunkVocoder
from voicebot.tts.cosyvoice2.flow import Flow, FlowCache, FlowRequest
from voicebot.tts.cosyvoice2.flow_window import SlotState, WindowRequest
from voicebot.tts.cosyvoice2.hift import DecodeJob, HiFT, HiFTStream
from voicebot.tts.cosyvoice2.sampling import host_to_device


@dataclass(frozen=True)
class FlowPrompt:
    """What the flow needs from a voice: prompt tokens (1, P), their mel (1, 2P, 80), speaker (1, 192)."""

    token: Tensor
    feat: Tensor
    embedding: Tensor

    def key(self) -> str:
        """Content key of the prompt: engines rebuild FlowPrompt objects per request."""
        digest = hashlib.sha1()
        for t in (self.token, self.feat, self.embedding):
            digest.update(str((t.dtype, tuple(t.shape))).encode())
            digest.update(t.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()


@dataclass(frozen=True)
class StreamSchedule:
    """The official wrapper's constants; None takes the flow's training chunk size (25 tokens)."""

    hop_tokens: int | None = None
    max_hop_tokens: int = 100
    hop_growth: int = 2
    mel_cache_frames: int = 8


Mode = Literal["recompute", "exact", "fast"]
MODES: tuple[Mode, ...] = ("recompute", "exact", "fast")


class Renderer(Protocol):
    """What a stream asks of the Token2Wav it renders on (token2wav.py): the models, the schedule
    and window it follows, its first flow state, its renders."""

    flow: Flow
    hift: HiFT
    schedule: StreamSchedule
    flow_left_chunks: int

    def stream_state(self, prompt: FlowPrompt) -> FlowCache | SlotState: ...

    def render(self, requests: list[ChunkRequest]) -> list[Tensor]: ...

    def frames_s(self, frames: int) -> float: ...


@dataclass(eq=False)
class ChunkRequest:
    """A stream's next chunk, from `Token2WavStream.next_chunk`, for `Token2Wav.render`: its first
    `n_tokens` speech tokens, voiced from token `offset` on; the utterance's last chunk when
    `finalize`. Valid until the stream renders a chunk."""

    stream: Token2WavStream
    n_tokens: int
    offset: int
    finalize: bool

    def audio_s(self) -> float:
        """The seconds of audio this chunk computes: its tokens past the offset, lookahead included."""
        t2w = self.stream.t2w
        return t2w.frames_s((self.n_tokens - self.offset) * t2w.flow.token_mel_ratio)


class Token2WavStream:
    """One request's streaming state. Driven either by itself — `push` tokens as the LM emits them
    and play the chunks it returns, `finish` once the LM has stopped — or by a scheduler that
    batches streams: `add` tokens, `end` when the LM has stopped, and pass `next_chunk()` (when not
    None) to `Token2Wav.render` with other streams' chunks. Chunks are (1, n) float32."""

    def __init__(self, t2w: Renderer, prompt: FlowPrompt, zero_noise: bool, generator: torch.Generator | None,
                 mode: Mode = "exact") -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not in {MODES}")
        self.t2w, self.prompt, self.mode = t2w, prompt, mode
        flow = t2w.flow
        self.lookahead = flow.pre_lookahead_len
        self.hop = t2w.schedule.hop_tokens or flow.encoder.chunk_size
        n_prompt = prompt.token.shape[1]
        # pad the first hop so that prompt + hop ends on a chunk boundary
        self.first_pad = math.ceil(n_prompt / self.hop) * self.hop - n_prompt
        self.tokens: list[int] = []
        self.offset = 0  # tokens already voiced
        self.ended = False  # no more tokens will come
        self.finished = False  # the last chunk has been rendered
        self.closed = False  # cancelled: never rendered again
        self.vocoder: HiFTStream | ChunkVocoder = (
            HiFTStream(t2w.hift, zero_noise, generator) if mode == "fast"
            else ChunkVocoder(t2w.hift, t2w.schedule.mel_cache_frames, zero_noise, generator))
        # this request's flow frames so far, after the voice's shared prompt state; the buffers
        # grow by each chunk's frames (estimator.py), so they hold exactly the frames computed;
        # bucketed: its slot of the pool, the window's frames
        self.flow_cache: FlowCache | SlotState | None = None
        if mode != "recompute":
            self.flow_cache = t2w.stream_state(prompt)

    def _next_hop(self) -> int:
        return self.hop + (self.first_pad if self.offset == 0 else 0)

    @property
    def tokens_for_next_chunk(self) -> int:
        """How many tokens in total the next non-final chunk needs."""
        return self.offset + self._next_hop() + self.lookahead

    def add(self, tokens: Iterable[int]) -> None:
        """Add speech tokens without rendering anything."""
        if self.ended:
            raise RuntimeError("tokens after the end")
        self.tokens.extend(int(t) for t in tokens)

    def end(self) -> None:
        """No more tokens will come: what is left becomes the final chunk."""
        self.ended = True

    def next_chunk(self) -> ChunkRequest | None:
        """The chunk that can be rendered now, None while it waits for tokens (or after the last)."""
        if self.finished:
            return None
        if len(self.tokens) >= self.tokens_for_next_chunk:
            return ChunkRequest(self, self.tokens_for_next_chunk, self.offset, finalize=False)
        if self.ended and self.tokens:
            return ChunkRequest(self, len(self.tokens), self.offset, finalize=True)
        return None

    def push(self, tokens: Iterable[int]) -> list[Tensor]:
        """Add speech tokens; returns the audio chunks that became ready (possibly none)."""
        self.add(tokens)
        chunks = []
        while (request := self.next_chunk()) is not None:
            chunks += self.t2w.render([request])
        return chunks

    def finish(self) -> Tensor:
        """All tokens are in: render the remaining ones, ending the audio without hold-back."""
        self.end()
        # push already rendered every chunk the tokens allowed, so what is left is the final one
        request = self.next_chunk()
        if request is None:  # no tokens at all
            self.finished = True
            return torch.zeros(1, 0)
        return self.t2w.render([request])[0]

    def close(self) -> None:
        """The stream is cancelled and will not be asked again (any thread): its flow slot, if it
        has one, is free at once; a chunk of it already handed to a render renders nothing."""
        self.closed = True
        state = self.flow_cache  # read once: the render's thread may drop it meanwhile (the last chunk)
        if isinstance(state, SlotState):
            state.slot.release()

    def _check(self, request: ChunkRequest) -> None:
        if request.stream is not self or request.offset != self.offset or self.finished:
            raise ValueError("stale chunk request: the stream has rendered a chunk since")

    def _flow_request(self, request: ChunkRequest) -> FlowRequest | WindowRequest:
        p = self.prompt
        # pinned and non-blocking on CUDA: a pageable copy would make the host wait for the device
        token = host_to_device(self.tokens[: request.n_tokens], p.token.device, torch.int32)[None]
        window = self.t2w.flow_left_chunks
        if self._cached(request) and isinstance(self.flow_cache, SlotState):  # at a bucket's shapes
            return WindowRequest(torch.cat([p.token, token], dim=1), p.feat, p.embedding, request.finalize,
                                 self.flow_cache)
        if self._cached(request):  # chunk-causal, new frames only
            return FlowRequest(token, p.token, p.feat, p.embedding, True, request.finalize, self.flow_cache, window)
        # non-final chunks use chunk-causal attention; the final one full attention (official behaviour)
        return FlowRequest(token, p.token, p.feat, p.embedding, not request.finalize, request.finalize, None, window)

    def _cached(self, request: ChunkRequest) -> bool:
        return self.flow_cache is not None and not (request.finalize and self.mode == "exact")

    def _advance(self, request: ChunkRequest, mel: Tensor) -> DecodeJob | None:
        """Take the chunk's flow output, move past the chunk, and prepare its vocoding."""
        if not self._cached(request):
            mel = mel[:, :, self.offset * self.t2w.flow.token_mel_ratio :]  # (1, 80, new frames)
        if request.finalize:
            self.finished = True
            if isinstance(self.flow_cache, SlotState):  # its slot goes to the next stream opened
                self.flow_cache.slot.release()
            self.flow_cache = None  # the request's largest state: free it with the last chunk
        else:
            self.offset += self._next_hop()
            sched = self.t2w.schedule
            self.hop = min(sched.max_hop_tokens, self.hop * sched.hop_growth)
        return self.vocoder.prepare(mel, final=request.finalize)
