"""Speech tokens → 24 kHz audio, whole or streamed (the official CosyVoice2Model.tts path, spec §9).

Streaming follows the official schedule exactly, with its state kept per request instead of on
the shared model (the official wrapper leaks the grown hop into later requests, spec §9.3 (a)):

- a chunk is rendered once `hop + lookahead` tokens past the offset exist; the first hop is padded
  so that prompt + hop ends on a flow chunk boundary, later hops grow 25 → 50 → 100;
- each chunk runs the flow with chunk-causal attention and a 3-token lookahead and keeps only the
  new mel frames;
- HiFT re-runs the last 8 mel frames of the previous chunk with that chunk's source tail, and the
  first 3840 samples are cross-faded with the previous chunk's held-back tail;
- the last chunk uses `finalize=True` and full attention, as the official code does.

That vocoding leaves audible seams (HiFT sees no right context and restarts its sine phase each
chunk), so "fast" vocodes with `HiFTStream` instead, which holds back enough mel frames that its
audio equals one HiFT call over the whole mel.

Three modes differ in how the flow gets those frames (and "fast" in how they are vocoded):

- "recompute": the official algorithm, every chunk re-runs the flow over all tokens, prompt included
  (kept as the reference for tests and the benchmark);
- "exact": the same output; non-final chunks compute only their new frames against a FlowCache that
  starts from the voice's cached prompt state; the final chunk still re-runs everything with full
  attention, as the official code does;
- "fast": as "exact", but the final chunk too is chunk-causal and cached (the official
  `streaming=True, finalize=True` flow output), so no chunk re-runs the prefix, and the mel goes
  through `HiFTStream`: the audio is one HiFT call over the chunk-causal mel, cut differently into
  chunks (each holds back `HiFTStream.lookahead` frames instead of the official 8). Its audio
  differs from "exact" (tests/cosyvoice2/test_speed_modes.py bounds and documents by how much).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from voicebot.tts.cosyvoice2.flow import Flow, FlowCache
from voicebot.tts.cosyvoice2.hift import HiFT, HiFTStream, SourceNoise


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


class Token2Wav:
    """Flow + HiFT, shared by all requests; holds no per-request state, only per-voice prompt
    states (the flow's prompt frames), the most recently used `max_prompt_states` of them."""

    def __init__(self, flow: Flow, hift: HiFT, schedule: StreamSchedule = StreamSchedule(),
                 mode: Mode = "exact", max_prompt_states: int = 4) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not in {MODES}")
        self.flow, self.hift, self.schedule, self.mode = flow, hift, schedule, mode
        self.max_prompt_states = max_prompt_states
        self._prompt_states: OrderedDict[str, FlowCache] = OrderedDict()

    def prompt_state(self, prompt: FlowPrompt) -> FlowCache:
        """The voice's cached flow prompt state, computed on first use. Requests `fork` it."""
        key = prompt.key()
        state = self._prompt_states.get(key)
        if state is None:
            state = self.flow.prompt_cache(prompt.token, prompt.feat, prompt.embedding)
            self._prompt_states[key] = state
            while len(self._prompt_states) > self.max_prompt_states:
                self._prompt_states.popitem(last=False)
        self._prompt_states.move_to_end(key)
        return state

    def evict_prompt_state(self, prompt: FlowPrompt) -> None:
        """Forget a voice's prompt state, so the next use recomputes it (the periodic reset)."""
        self._prompt_states.pop(prompt.key(), None)

    def prompt_state_bytes(self) -> dict[str, int]:
        """Bytes held per cached voice prompt state (keyed by prompt content hash)."""
        return {key: state.nbytes() for key, state in self._prompt_states.items()}

    def _vocode(
        self, mel: Tensor, cache_source: Tensor | None, zero_noise: bool, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        noise = None
        if zero_noise:
            n_samples = mel.shape[2] * self.hift.samples_per_frame
            noise = SourceNoise.zeros(n_samples, self.hift.m_source.n_harmonics, mel.device)
        return self.hift.inference(mel, cache_source=cache_source, noise=noise, generator=generator)

    @torch.inference_mode()
    def full(
        self, tokens: Tensor, prompt: FlowPrompt, speed: float = 1.0, zero_noise: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Non-streaming: all tokens (1, N) at once -> waveform (1, 480·2N/speed)."""
        mel = self.flow.inference(tokens, prompt.token, prompt.feat, prompt.embedding, streaming=False, finalize=True)
        if speed != 1.0:
            mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
        return self._vocode(mel, None, zero_noise, generator)[0]

    def stream(
        self, prompt: FlowPrompt, zero_noise: bool = False, generator: torch.Generator | None = None,
        mode: Mode | None = None,
    ) -> Token2WavStream:
        """A new request's streaming state (zero_noise: HiFT source noise off, for tests; mode:
        this request's, default the Token2Wav's)."""
        return Token2WavStream(self, prompt, zero_noise, generator, mode or self.mode)


class Token2WavStream:
    """One request's streaming state. `push` tokens as the LM emits them and play the chunks it
    returns; `finish` once the LM has stopped returns the rest. Chunks are (1, n) float32."""

    def __init__(self, t2w: Token2Wav, prompt: FlowPrompt, zero_noise: bool, generator: torch.Generator | None,
                 mode: Mode = "exact") -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not in {MODES}")
        self.t2w, self.prompt, self.mode = t2w, prompt, mode

        self.zero_noise, self.generator = zero_noise, generator
        flow = t2w.flow
        sched = t2w.schedule
        self.lookahead = flow.pre_lookahead_len
        self.hop = sched.hop_tokens or flow.encoder.chunk_size
        n_prompt = prompt.token.shape[1]
        # pad the first hop so that prompt + hop ends on a chunk boundary
        self.first_pad = math.ceil(n_prompt / self.hop) * self.hop - n_prompt
        self.mel_cache_frames = sched.mel_cache_frames
        self.overlap = sched.mel_cache_frames * t2w.hift.samples_per_frame  # 3840 samples
        self.window = torch.from_numpy(np.hamming(2 * self.overlap))  # float64, as the official blend
        self.tokens: list[int] = []
        self.offset = 0  # tokens already voiced
        self.mel_cache: Tensor | None = None  # (1, 80, 8) last mel frames of the previous HiFT input
        self.source_cache: Tensor | None = None  # (1, 1, 3840) source tail of the previous chunk
        self.speech_tail: Tensor | None = None  # (1, 3840) held back for the cross-fade
        self.finished = False
        self.vocoder = HiFTStream(t2w.hift, zero_noise, generator) if mode == "fast" else None
        # this request's flow frames so far, after the voice's shared prompt state; the buffers
        # grow by each chunk's frames (estimator.py), so they hold exactly the frames computed
        self.flow_cache: FlowCache | None = None
        if mode != "recompute":
            self.flow_cache = t2w.prompt_state(prompt).fork()

    def _next_hop(self) -> int:
        return self.hop + (self.first_pad if self.offset == 0 else 0)

    @property
    def tokens_for_next_chunk(self) -> int:
        """How many tokens in total `push` needs before it renders the next chunk."""
        return self.offset + self._next_hop() + self.lookahead

    def push(self, tokens: Iterable[int]) -> list[Tensor]:
        """Add speech tokens; returns the audio chunks that became ready (possibly none)."""
        if self.finished:
            raise RuntimeError("push after finish")
        self.tokens.extend(int(t) for t in tokens)
        chunks = []
        while len(self.tokens) >= self.tokens_for_next_chunk:
            chunks.append(self._render(self.tokens_for_next_chunk, finalize=False))
            self.offset += self._next_hop()
            sched = self.t2w.schedule
            self.hop = min(sched.max_hop_tokens, self.hop * sched.hop_growth)
        return chunks

    def finish(self) -> Tensor:
        """All tokens are in: render the remaining ones, ending the audio without hold-back."""
        self.finished = True
        if not self.tokens:
            return torch.zeros(1, 0)
        return self._render(len(self.tokens), finalize=True)

    @torch.inference_mode()
    def _render(self, n_tokens: int, finalize: bool) -> Tensor:
        flow, p = self.t2w.flow, self.prompt
        token = torch.tensor(self.tokens[:n_tokens], dtype=torch.int32, device=p.token.device)[None]
        if self.flow_cache is not None and not (finalize and self.mode == "exact"):
            # chunk-causal, new frames only
            mel = flow.inference(token, p.token, p.feat, p.embedding, streaming=True, finalize=finalize,
                                 cache=self.flow_cache)
        else:
            # non-final chunks use chunk-causal attention; the final one full attention (official behaviour)
            mel = flow.inference(token, p.token, p.feat, p.embedding, streaming=not finalize, finalize=finalize)
            mel = mel[:, :, self.offset * flow.token_mel_ratio :]  # (1, 80, new frames)
        if finalize:
            self.flow_cache = None  # the request's largest state: free it with the last chunk
        if self.vocoder is not None:
            return self.vocoder.push(mel, final=finalize)
        if self.mel_cache is not None:
            mel = torch.cat([self.mel_cache, mel], dim=2)
        speech, source = self.t2w._vocode(mel, self.source_cache, self.zero_noise, self.generator)
        if self.speech_tail is not None:
            speech = self._crossfade(speech, self.speech_tail)
        if finalize:
            return speech
        self.mel_cache = mel[:, :, -self.mel_cache_frames :]
        self.source_cache = source[:, :, -self.overlap :]
        self.speech_tail = speech[:, -self.overlap :]
        return speech[:, : -self.overlap]

    def _crossfade(self, speech: Tensor, prev_tail: Tensor) -> Tensor:
        """Fade the first `overlap` samples in over the previous chunk's tail (Hamming halves)."""
        n, w = self.overlap, self.window.to(speech.device)
        head = speech[:, :n] * w[:n] + prev_tail * w[n:]  # float64, then back, like the official code
        return torch.cat([head.to(speech.dtype), speech[:, n:]], dim=1)
