"""Streams rendered together (Token2Wav.render) equal each stream rendered alone.

A batch changes nothing but the order of floating-point sums: a request's rows meet other
requests' rows only inside GEMMs (estimator) and convolutions (HiFT), where each output element is
still the same dot product over the same operands, only blocked differently by the BLAS for
another row count. fp32 rounds each sum to 2^-24 relative (6e-8); over the K ≤ 2048 terms of these
dot products that is at most K·2^-24 ≈ 1.2e-4 relative per layer in the worst case, about
√K·2^-24 ≈ 3e-6 typically. Through the 10 Euler steps and HiFT, that is the same kind and size of
difference as between our fp32 implementation and the official one (which differ in how they sum,
not in what), so the bounds are the golden tests' (golden_bounds.py, relative to the peak).
Errors reached (tiny fixture weights, fp32, 1 thread, Xeon AVX-512): flow mels 0 (bit-exact: the
GEMMs sum each row the same way whatever the row count); HiFT decode 9e-8 and session audio 9e-8
(the padded convolutions do not).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from golden_bounds import MEL, SOURCE, SPEECH, assert_close_to_peak, max_error_to_peak
from voicebot.config.base import REPO_ROOT
from voicebot.tts.cosyvoice2.flow import FlowRequest
from voicebot.tts.cosyvoice2.hift import SourceNoise, SourceRequest
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav

pytestmark = pytest.mark.golden

def _random_prompt(t2w: Token2Wav, n_prompt: int, seed: int) -> FlowPrompt:
    g = torch.Generator().manual_seed(seed)
    vocab = t2w.flow.input_embedding.num_embeddings
    return FlowPrompt(torch.randint(0, vocab, (1, n_prompt), generator=g, dtype=torch.int32),
                      torch.randn(1, 2 * n_prompt, 80, generator=g) * 2 - 5, torch.randn(1, 192, generator=g))


def _tokens(t2w: Token2Wav, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, t2w.flow.input_embedding.num_embeddings, (n,), generator=g).tolist()


@dataclass
class Session:
    """A simulated speaking session: joins at tick `join`, gets `per_tick` tokens a tick, and is
    dropped (barge-in) after `drop_after` chunks if set."""

    prompt: FlowPrompt
    tokens: list[int]
    mode: str
    join: int
    per_tick: int
    seed: int | None = None  # HiFT source noise from this seed; None: zero noise
    drop_after: int | None = None

    def stream(self, t2w: Token2Wav):
        generator = None if self.seed is None else torch.Generator().manual_seed(self.seed)
        return t2w.stream(self.prompt, zero_noise=self.seed is None, generator=generator, mode=self.mode)


def _alone(t2w: Token2Wav, session: Session) -> list[torch.Tensor]:
    stream = session.stream(t2w)
    chunks = stream.push(session.tokens) + [stream.finish()]
    return chunks if session.drop_after is None else chunks[: session.drop_after]


def _together(t2w: Token2Wav, sessions: list[Session], render_every: int = 4
              ) -> tuple[list[list[torch.Tensor]], list[int]]:
    """The scheduler's loop: each tick the active sessions add tokens (the LM's step); every
    `render_every` ticks every ready chunk of every session renders in shared calls until none is
    ready (a render takes the time of several LM steps). Returns each session's chunks and the
    batch sizes used."""
    chunks: list[list[torch.Tensor]] = [[] for _ in sessions]
    streams: dict[int, object] = {}
    fed = [0] * len(sessions)
    batch_sizes = []
    for tick in range(1000):
        for i, s in enumerate(sessions):
            if tick == s.join:
                streams[i] = s.stream(t2w)
            if i in streams and not streams[i].ended:
                streams[i].add(s.tokens[fed[i] : fed[i] + s.per_tick])
                fed[i] += s.per_tick
                if fed[i] >= len(s.tokens):
                    streams[i].end()
        while tick % render_every == 0 and (requests := [(i, r) for i, st in streams.items() if (r := st.next_chunk()) is not None]):
            batch_sizes.append(len(requests))
            for (i, _), audio in zip(requests, t2w.render([r for _, r in requests])):
                chunks[i].append(audio)
        for i, s in enumerate(sessions):
            if i in streams and (streams[i].finished or len(chunks[i]) == s.drop_after):
                del streams[i]  # left: finished, or dropped mid-reply with its state
        if tick > max(s.join for s in sessions) and not streams:
            return chunks, batch_sizes
    raise AssertionError("sessions did not finish")


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_sessions_rendered_together_equal_each_alone(t2w: Token2Wav, prompt: FlowPrompt, mode: str) -> None:
    """Different voices and prompt lengths (the fixture's 12 tokens, 37, 61), different chunk
    indices in one batch, sessions joining late, one dropped mid-reply, one with source noise."""
    _sessions_together_and_alone(t2w, prompt, mode)


def test_windowed_sessions_rendered_together_equal_each_alone(t2w: Token2Wav, prompt: FlowPrompt) -> None:
    """As above with a 1-chunk flow window: each segment's keys start at its own window, so the
    padded attention batch mixes segments of different key ranges and the caches drop frames."""
    _sessions_together_and_alone(Token2Wav(t2w.flow, t2w.hift, flow_left_chunks=1), prompt, "fast")


def _sessions_together_and_alone(t2w: Token2Wav, prompt: FlowPrompt, mode: str) -> None:
    sessions = [
        Session(prompt, _tokens(t2w, 150, 1), mode, join=0, per_tick=9),
        Session(_random_prompt(t2w, 37, 2), _tokens(t2w, 120, 2), mode, join=0, per_tick=8, seed=5),
        Session(_random_prompt(t2w, 61, 3), _tokens(t2w, 200, 3), mode, join=2, per_tick=15),
        Session(prompt, _tokens(t2w, 160, 4), mode, join=4, per_tick=12, drop_after=2),
    ]
    together, batch_sizes = _together(t2w, sessions)
    assert max(batch_sizes) >= 3, f"the schedule never batched: {batch_sizes}"
    for i, session in enumerate(sessions):
        alone = _alone(t2w, session)
        assert [c.shape for c in together[i]] == [c.shape for c in alone], f"session {i}"
        errors = [max_error_to_peak(a, b) for a, b in zip(together[i], alone)]
        assert max(errors) <= SPEECH, f"session {i}: max abs error per chunk, of its peak: {errors}"


def test_flow_requests_rendered_together_equal_each_alone(t2w: Token2Wav, prompt: FlowPrompt) -> None:
    """Flow.render mixing cached chunk-causal, uncached chunk-causal and full-attention requests,
    unbounded and windowed."""
    flow = t2w.flow
    other = _random_prompt(t2w, 50, 9)
    tokens = torch.tensor([_tokens(t2w, 90, 8)], dtype=torch.int32)

    def requests() -> list[FlowRequest]:
        state = t2w.prompt_state(other).fork()
        flow.inference(tokens[:, :53], other.token, other.feat, other.embedding, True, False, state)  # chunk 0
        args = (prompt.token, prompt.feat, prompt.embedding)
        return [FlowRequest(tokens[:, :78], other.token, other.feat, other.embedding, True, False, state),
                FlowRequest(tokens[:, :41], *args, streaming=True, finalize=False),
                FlowRequest(tokens, *args, streaming=False, finalize=True),
                FlowRequest(tokens[:, :77], *args, streaming=True, finalize=True,
                            cache=t2w.prompt_state(prompt).fork()),
                FlowRequest(tokens[:, :66], *args, streaming=True, finalize=False, left_chunks=0),
                FlowRequest(tokens[:, :41], *args, True, False, flow.prompt_cache(*args, left_chunks=1).fork(), 1)]

    alone = [flow.render([r])[0] for r in requests()]
    together = flow.render(requests())
    for i, (a, b) in enumerate(zip(together, alone)):
        assert_close_to_peak(a, b, MEL, f"request {i}")


def test_hift_decode_batch_equals_each_alone(t2w: Token2Wav) -> None:
    hift = t2w.hift
    g = torch.Generator().manual_seed(3)
    mels = [torch.randn(1, 80, n, generator=g) for n in (7, 30, 1, 30, 58)]
    with torch.inference_mode():
        sources = [hift.excitation(m, noise=SourceNoise.zeros(m.shape[2] * hift.samples_per_frame,
                                                              hift.m_source.n_harmonics)) for m in mels]
        together = hift.decode_batch(mels, sources)
        for i, (mel, source, wav) in enumerate(zip(mels, sources, together)):
            assert_close_to_peak(wav, hift.decode(mel, source), SPEECH, f"mel {i} of {mel.shape[2]} frames")


def test_hift_excitations_batch_equals_each_alone(t2w: Token2Wav) -> None:
    """Every stream's f0 and source in one batch (HiFT.excitations): rows of different lengths,
    fresh and continuing utterances (rand_ini against a carried phase), an f0 context cut off on
    the left, a source head, noise on and off: each row as its request alone. The source's phase
    is a running sum in float64, so the batch reaches the same values bit for bit but for the f0
    predictor's convolutions (blocked differently for another row count): the SOURCE bound."""
    hift, h, spf = t2w.hift, t2w.hift.m_source.n_harmonics, t2w.hift.samples_per_frame
    g = torch.Generator().manual_seed(5)

    def request(frames: int, f0_from: int = 0, noise: bool = True, carried: bool = False, head: int = 0):
        mel = torch.randn(1, 80, frames, generator=g) * 2 - 5
        n = (frames - f0_from) * spf
        return SourceRequest(mel, SourceNoise(torch.rand(1, h, generator=g), torch.randn(1, n, h, generator=g))
                             if noise else None, f0_from,
                             torch.rand(1, h, 1, generator=g, dtype=torch.float64) * 40 if carried else None,
                             torch.randn(1, 1, head, generator=g) if head else None)

    requests = [request(7), request(30, 6, carried=True), request(1, noise=False), request(58, 20, head=3840),
                request(30, noise=False, carried=True)]
    with torch.inference_mode():
        together = hift.excitations(requests)
        for i, (r, (source, cycles)) in enumerate(zip(requests, together)):
            alone_source, alone_cycles = hift.excitations([r])[0]
            assert source.shape == alone_source.shape and cycles.shape == alone_cycles.shape
            assert_close_to_peak(source, alone_source, SOURCE, f"request {i}: source")
            assert_close_to_peak(cycles, alone_cycles, SOURCE, f"request {i}: phase")


def test_render_refuses_a_stale_request_and_two_of_one_stream(t2w: Token2Wav, prompt: FlowPrompt) -> None:
    stream = t2w.stream(prompt, zero_noise=True)
    stream.add(_tokens(t2w, 120, 6))
    first = stream.next_chunk()
    with pytest.raises(ValueError, match="one chunk per stream"):
        t2w.render([first, stream.next_chunk()])
    t2w.render([first])
    with pytest.raises(ValueError, match="stale"):
        t2w.render([first])


def test_flow_benchmark_smoke_run(cv2_dir: Path) -> None:
    """bench/flow.py at the fixture sizes: every section runs and prints its figures."""
    run = subprocess.run([sys.executable, "-m", "bench.flow", "--size", "tiny", "--reps", "1", "--threads", "1",
                          "--fixtures", str(cv2_dir)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for line in ("before / ours", "8 sessions in one render", "8 window(s)", "official / before"):
        assert line in run.stdout, run.stdout
