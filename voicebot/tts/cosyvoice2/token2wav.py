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

Rendering many streams together (the device scheduler's API). A stream either renders itself
(`push` tokens, `finish`) or is driven by a scheduler that batches the chunks of many streams:

    stream = t2w.stream(prompt, generator=g)     # per reply; holds that reply's flow and HiFT state
    stream.add(tokens)                           # as the LM emits them (no rendering)
    stream.end()                                 # the LM has stopped: the rest is the final chunk
    requests = [r for s in streams if (r := s.next_chunk()) is not None]
    audio = t2w.render(requests)                 # one (1, n) float32 chunk per request, in order

`render` runs every request's encoder on its own (≈3 % of the flow), then one Euler schedule for
all of them: each of the 10 steps is one estimator call over every request's CFG pair, packed
row by row, attention padded and masked per request (estimator.py), each attending to its own
prompt state and cached frames (within its window, flow_left_chunks); then every stream's f0 and
source in one batch (hift.py `excitations`) and one HiFT decode over all their mel windows
(`decode_batch`). Requests may differ in voice,
prompt length, chunk index, hop and mode. `push`/`finish` are `render([stream.next_chunk()])`.
A request's audio equals its stream's render alone to fp32 reduction order (test_flow_batch.py).
One render call is bounded: at most `max_render_streams` streams (more are rendered in successive
calls of at most that many, in order, every request answered), each chunk at most
`max_chunk_frames` new mel frames (the schedule's longest: a 100-token hop and the 3-token
lookahead, 206 frames, 4.1 s of audio).

`bucketed=True` (a bounded flow window needed): the cached flow chunks run at bucketed static shapes
(flow_window.py), HiFT's decode likewise (padded rows and frames masked), so that on CUDA every
bucket is one CUDA graph, all captured by `capture_graphs` at start-up; elsewhere the same padded
shapes run eagerly (tests/cosyvoice2/test_buckets.py: equal to the eager flow at exact shapes).
Uncached chunks (the official "recompute", "exact"'s full-attention final chunk) stay eager.
A bucketed stream's flow state is a slot of the window flow's pool (flow_window.py `SlotPool`),
the stream's from `stream()` (SlotsExhausted past `max_streams` open streams) until its last chunk
renders, `close()`, or the stream object is dropped.
Rules: at most one request per stream per render (its next chunk depends on the previous one); a
request is valid until its stream renders (`render` refuses a stale one); streams are opened and
rendered on one thread. A cancelled stream is not asked again and is closed (any thread: its slot
is free at once); a chunk of it already handed to a render renders nothing (`closed_chunks`).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from voicebot.serving.model_interfaces import Rendering
from voicebot.serving.render_queue import AudioBudget
from voicebot.tts.base import SAMPLE_RATE
from voicebot.tts.cosyvoice2.flow import Flow, FlowCache, FlowRequest
from voicebot.tts.cosyvoice2.flow_window import SlotState, WindowFlow, WindowRequest, WindowState
from voicebot.tts.cosyvoice2.hift import HiFT, SourceNoise
from voicebot.tts.cosyvoice2.hift_buckets import HiFTBuckets
from voicebot.tts.cosyvoice2.token2wav_stream import MODES, ChunkRequest, FlowPrompt, Mode, StreamSchedule, Token2WavStream


class Token2Wav:
    """Flow + HiFT, shared by all requests; holds no per-request state, only per-voice prompt
    states (the flow's prompt frames), the most recently used `max_prompt_states` of them.

    `flow_left_chunks` (the official `num_decoding_left_chunks`): the streaming flow's attention
    sees that many 50-frame chunks before a frame's own (−1: all, as the official code always
    does). A stream's flow state then holds at most that window, whatever the reply's length;
    the mel differs from the unbounded one (tests/cosyvoice2/test_flow_window.py measures by how much).
    """

    def __init__(self, flow: Flow, hift: HiFT, schedule: StreamSchedule = StreamSchedule(),
                 mode: Mode = "exact", max_prompt_states: int = 4, flow_left_chunks: int = -1,
                 max_render_streams: int = 8, bucketed: bool = False, max_streams: int = 16) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not in {MODES}")
        if flow_left_chunks < -1:
            raise ValueError(f"flow_left_chunks {flow_left_chunks}: -1 (all) or a number of chunks")
        self.flow, self.hift, self.schedule, self.mode = flow, hift, schedule, mode
        self.flow_left_chunks = flow_left_chunks
        self.max_prompt_states = max_prompt_states
        self._prompt_states: OrderedDict[str, FlowCache | WindowState] = OrderedDict()
        # One render call's bound: at most max_render_streams streams, each at most
        # `max_chunk_frames` new mel frames (the schedule's longest chunk); more streams are split
        # into calls of at most that many (render), so every call fits the largest bucket.
        self.max_render_streams = max_render_streams
        self.max_chunk_frames = self._max_chunk_frames()
        self.closed_chunks = 0  # chunks of streams closed before their render: not rendered, no one to hear them
        self.window_flow: WindowFlow | None = None
        self.hift_buckets: HiFTBuckets | None = None
        if bucketed:  # flow and HiFT at bucketed static shapes (flow_window.py), captured on CUDA
            pool = torch.cuda.graph_pool_handle() if hift.conv_pre.bias.device.type == "cuda" else None
            streams = tuple(sorted({*(2**i for i in range(max_render_streams.bit_length())), max_render_streams}))
            # max_streams: the streams open at once (serving: one per LM slot), each a slot of the pool
            self.window_flow = WindowFlow(flow, flow_left_chunks, streams, self.max_chunk_frames, max_streams, pool)
            context, f0_context = hift.context_frames()
            longest = self.max_chunk_frames + max(schedule.mel_cache_frames, 2 * context + f0_context)
            self.hift_buckets = HiFTBuckets(hift, streams, longest, pool)

    def _max_chunk_frames(self) -> int:
        """The most new mel frames of one chunk: the longest hop (the first, padded to a chunk
        boundary, is under twice the first hop) and the lookahead, at 2 frames a token."""
        hop = self.schedule.hop_tokens or self.flow.encoder.chunk_size
        tokens = max(2 * hop - 1, self.schedule.max_hop_tokens) + self.flow.pre_lookahead_len
        return tokens * self.flow.token_mel_ratio

    def render_budget(self) -> AudioBudget:
        """A scheduler's render call's bound in audio (render_queue.py): `max_render_streams` of the
        longest first chunks (a first hop padded to a chunk boundary and the lookahead: 104 frames,
        2.08 s), so a call with a reply's first chunk in it costs at most what a call of first chunks
        does; a call of the longest chunks (4.12 s) takes half as many streams (and one at least:
        with max_render_streams 1 the budget is the longest chunk). Bucketed, a call's audio is its
        chunks padded to the longest; eager, their sum."""
        hop = self.schedule.hop_tokens or self.flow.encoder.chunk_size
        first_frames = (2 * hop - 1 + self.flow.pre_lookahead_len) * self.flow.token_mel_ratio
        longest = self.frames_s(self.max_chunk_frames)
        return AudioBudget(ChunkRequest.audio_s, max(self.max_render_streams * self.frames_s(first_frames), longest),
                           longest, padded=self.window_flow is not None)

    def frames_s(self, frames: int) -> float:
        """The seconds of audio `frames` mel frames make."""
        return frames * self.hift.samples_per_frame / SAMPLE_RATE

    def capture_graphs(self) -> int:
        """Capture every bucket's CUDA graph, flow and HiFT (start-up, before any render): how many."""
        if self.window_flow is None:
            raise ValueError("graphs are captured for a bucketed Token2Wav")
        return self.window_flow.capture() + self.hift_buckets.capture()

    def prompt_state(self, prompt: FlowPrompt) -> FlowCache | WindowState:
        """The voice's cached flow prompt state, computed on first use. Requests `fork` it."""
        key = prompt.key()
        state = self._prompt_states.get(key)
        self.put_prompt_state(prompt, self.new_prompt_state(prompt) if state is None else state)
        return self._prompt_states[key]

    def new_prompt_state(self, prompt: FlowPrompt) -> FlowCache:
        """The voice's flow prompt state, computed and not cached: another thread may make it while
        this one renders (the weights are only read), then `put_prompt_state` it between renders."""
        return self.flow.prompt_cache(prompt.token, prompt.feat, prompt.embedding, self.flow_left_chunks)

    def put_prompt_state(self, prompt: FlowPrompt, state: FlowCache | WindowState) -> None:
        """Cache `state` as the voice's, the most recently used; the least recently used past
        max_prompt_states are dropped. Bucketed, it is kept in the layout a bucketed call reads."""
        if self.window_flow is not None and isinstance(state, FlowCache):
            state = self.window_flow.state(state)
        key = prompt.key()
        self._prompt_states[key] = state
        self._prompt_states.move_to_end(key)
        while len(self._prompt_states) > self.max_prompt_states:
            self._prompt_states.popitem(last=False)

    def stream_state(self, prompt: FlowPrompt) -> FlowCache | SlotState:
        """A new stream's flow state: a fork of its voice's prompt state, or, bucketed, a slot of the
        pool that its first render loads with it (SlotsExhausted when every slot is owned)."""
        state = self.prompt_state(prompt)
        return self.window_flow.open(state) if isinstance(state, WindowState) else state.fork()

    def prompt_state_bytes(self) -> dict[str, int]:
        """Bytes held per cached voice prompt state (keyed by prompt content hash)."""
        return {key: state.nbytes() for key, state in self._prompt_states.items()}

    @torch.inference_mode()
    def render(self, requests: list[ChunkRequest]) -> list[Tensor]:
        """Render one chunk of each of several streams together: one flow call (every Euler step
        one estimator call over all of them) and one batched HiFT decode. Returns each request's
        audio (1, n) float32, which equals what the stream alone would have rendered (to fp32
        reduction order); the streams' state has moved on past the chunk."""
        closed = [r.stream.closed for r in requests]
        if any(closed):  # their sessions have gone: the others render
            self.closed_chunks += sum(closed)
            audio = iter(self.render([r for r, gone in zip(requests, closed) if not gone]))
            return [torch.zeros(1, 0) if gone else next(audio) for gone in closed]
        streams = [r.stream for r in requests]
        if len({id(s) for s in streams}) != len(streams):
            raise ValueError("one chunk per stream in a render: a stream's next chunk needs its previous one")
        for r in requests:
            r.stream._check(r)
        if len(requests) > self.max_render_streams:  # the call's bound: split, in order, nothing lost
            return [audio for at in range(0, len(requests), self.max_render_streams)
                    for audio in self.render(requests[at : at + self.max_render_streams])]
        flow_requests = [r.stream._flow_request(r) for r in requests]
        mels: list[Tensor | None] = [None] * len(requests)
        for kind, render in ((FlowRequest, self.flow.render), (WindowRequest, self._render_window)):
            at = [i for i, f in enumerate(flow_requests) if isinstance(f, kind)]
            if at:
                for i, mel in zip(at, render([flow_requests[i] for i in at])):
                    mels[i] = mel
        jobs = [r.stream._advance(r, mel) for r, mel in zip(requests, mels)]
        ready = [(r.stream.vocoder, job) for r, job in zip(requests, jobs) if job is not None]
        if ready:  # every stream's f0 and source in one batch, then every decode in one
            for (vocoder, job), made in zip(ready, self.hift.excitations([job.source_request for _, job in ready])):
                vocoder.sourced(job, *made)
        decode = self.hift.decode_batch if self.hift_buckets is None else self.hift_buckets.decode
        decoded = iter(decode([j.mel for _, j in ready], [j.source for _, j in ready]) if ready else ())
        return [torch.zeros(1, 0) if job is None else r.stream.vocoder.complete(job, next(decoded))
                for r, job in zip(requests, jobs)]

    def _render_window(self, requests: list[WindowRequest]) -> list[Tensor]:
        return self.window_flow.render(requests)

    def launch(self, requests: list[ChunkRequest], side: torch.cuda.Stream) -> Rendering:
        """`render` launched on the CUDA stream `side` and handed back still running: the caller
        steps the LM on its own stream meanwhile (they share no tensor; `side` first waits for
        what the caller's stream was given, such as the tokens). The audio comes back through
        pinned memory. Its device tensors may be freed at once: the caching allocator reuses their
        memory only for later work on `side`."""
        side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side):
            audio = [a.reshape(-1).float() for a in self.render(requests)]
            host = [torch.empty(a.shape, dtype=torch.float32, pin_memory=True) for a in audio]
            for h, a in zip(host, audio, strict=True):
                h.copy_(a, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)

        def audio_when_done() -> list[np.ndarray]:
            done.synchronize()
            return [h.numpy() for h in host]

        return Rendering(ready=done.query, audio=audio_when_done)

    @torch.inference_mode()
    def full(
        self, tokens: Tensor, prompt: FlowPrompt, speed: float = 1.0, zero_noise: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Non-streaming: all tokens (1, N) at once -> waveform (1, 480·2N/speed)."""
        mel = self.flow.inference(tokens, prompt.token, prompt.feat, prompt.embedding, streaming=False, finalize=True)
        if speed != 1.0:
            mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
        return self.hift.inference(mel, noise=_zero_noise(self.hift, mel) if zero_noise else None, generator=generator)[0]

    def stream(
        self, prompt: FlowPrompt, zero_noise: bool = False, generator: torch.Generator | None = None,
        mode: Mode | None = None,
    ) -> Token2WavStream:
        """A new request's streaming state (zero_noise: HiFT source noise off, for tests; mode:
        this request's, default the Token2Wav's)."""
        return Token2WavStream(self, prompt, zero_noise, generator, mode or self.mode)


def _zero_noise(hift: HiFT, mel: Tensor) -> SourceNoise:
    return SourceNoise.zeros(mel.shape[2] * hift.samples_per_frame, hift.m_source.n_harmonics, mel.device)
