"""Flow and HiFT at bucketed static shapes (flow_window.py, Token2Wav(bucketed=True)): what a CUDA
graph captures per bucket, run eagerly here at the same padded shapes.

A stream rendered at a padded bucket (more streams, more frames, masked) equals it rendered by the
eager flow at its exact shape. The padding changes no operand of a valid row: the padded keys are
masked out (−inf, so exactly 0 weight), the padded frames come after the valid ones and causal
convolutions read only earlier frames, and HiFT zeroes every convolution's input past a row's end.
What differs is the row count of each GEMM and the key count of each softmax (BLAS blocking, the
sum over exp(−inf) = 0 terms), so the bounds are the batch tests' (golden_bounds, relative to the
peak): MEL for mels, SPEECH for audio. Errors reached (tiny fixtures, fp32, 1 thread): mel ≤ 4.9e-7
of its peak, audio ≤ 5.7e-4 (HiFT amplifies the mel's rounding, as golden_bounds.py notes).
"""

from __future__ import annotations

import pytest
import torch

from golden_bounds import MEL, SPEECH, max_error_to_peak
from test_flow_batch import Session, _alone, _random_prompt, _together, _tokens
from voicebot.tts.cosyvoice2.flow_window import SlotState
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav

pytestmark = pytest.mark.golden


def _bucketed(t2w: Token2Wav, left_chunks: int = 1, **kwargs) -> Token2Wav:
    return Token2Wav(t2w.flow, t2w.hift, flow_left_chunks=left_chunks, bucketed=True, **kwargs)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_streams_at_padded_buckets_equal_the_eager_flow_at_their_shapes(t2w: Token2Wav, prompt: FlowPrompt,
                                                                         mode: str) -> None:
    """Sessions of different voices and prompt lengths, chunk indices and joins, one dropped, one
    with source noise, rendered together at buckets (3 streams in a bucket of 4, chunks of 50 to
    206 frames in buckets of 50 to 250), against each alone through the eager flow at its shapes."""
    eager = Token2Wav(t2w.flow, t2w.hift, flow_left_chunks=1)
    bucketed = _bucketed(t2w)
    sessions = [
        Session(prompt, _tokens(t2w, 150, 1), mode, join=0, per_tick=9),
        Session(_random_prompt(t2w, 37, 2), _tokens(t2w, 120, 2), mode, join=0, per_tick=8, seed=5),
        Session(_random_prompt(t2w, 61, 3), _tokens(t2w, 200, 3), mode, join=2, per_tick=15),
        Session(prompt, _tokens(t2w, 160, 4), mode, join=4, per_tick=12, drop_after=2),
    ]
    together, batch_sizes = _together(bucketed, sessions)
    assert 3 in batch_sizes, f"no render padded 3 streams to a bucket of 4: {batch_sizes}"
    for i, session in enumerate(sessions):
        alone = _alone(eager, session)
        assert [c.shape for c in together[i]] == [c.shape for c in alone], f"session {i}"
        errors = [max_error_to_peak(a, b) for a, b in zip(together[i], alone)]
        assert max(errors) <= SPEECH, f"session {i}: max abs error per chunk, of its peak: {errors}"


def test_a_padded_flow_bucket_equals_the_exact_mel(t2w: Token2Wav, prompt: FlowPrompt) -> None:
    """One stream's mel chunk by chunk (before HiFT): its first chunk beside another stream's, then
    alone in frame buckets, its final chunk not filling its bucket: each within MEL of the eager
    flow's mel at its own shape."""
    eager, bucketed = Token2Wav(t2w.flow, t2w.hift, flow_left_chunks=1), _bucketed(t2w, max_render_streams=2)
    tokens = _tokens(t2w, 120, 7)
    mels = {}
    for name, t in (("eager", eager), ("bucketed", bucketed)):
        stream, other = t.stream(prompt, zero_noise=True, mode="fast"), t.stream(prompt, zero_noise=True, mode="fast")
        other.add(tokens[:60])
        stream.add(tokens)
        stream.end()
        got = []
        original = t.flow.render if name == "eager" else t.window_flow.render

        def keep(requests, original=original):
            out = original(requests)
            got.append(out[0])
            return out

        if name == "eager":
            t.flow.render = keep
        else:
            t.window_flow.render = keep
        try:
            while (request := stream.next_chunk()) is not None:
                t.render([request] + ([other.next_chunk()] if name == "bucketed" and other.next_chunk() else []))
        finally:
            del (t.flow if name == "eager" else t.window_flow).render
        mels[name] = got
    assert [m.shape[2] for m in mels["eager"]] == [m.shape[2] for m in mels["bucketed"]]
    assert mels["eager"][-1].shape[2] % 50, "the final chunk should not fill its bucket"
    for i, (a, b) in enumerate(zip(mels["bucketed"], mels["eager"])):
        assert max_error_to_peak(a, b) <= MEL, f"chunk {i}"


def test_the_bucket_set_is_bounded_and_written_down(t2w: Token2Wav, prompt: FlowPrompt) -> None:
    """Streams in powers of two up to the render batch; the flow's frames in chunks up to the
    schedule's longest chunk (100-token hop + 3 lookahead = 206 frames -> 250); HiFT's windows in
    steps of 32 up to that chunk plus its context. A chunk beyond the set is an error, not a
    silent fallback."""
    t = _bucketed(t2w, max_render_streams=8)
    assert t.max_chunk_frames == 206
    assert t.window_flow.buckets == [(s, q) for s in (1, 2, 4, 8) for q in (50, 100, 150, 200, 250)]
    context, f0_context = t2w.hift.context_frames()
    longest = 206 + max(8, 2 * context + f0_context)
    assert {b for _, b in t.hift_buckets.buckets} == set(range(32, -(-longest // 32) * 32 + 1, 32))
    assert {s for s, _ in t.hift_buckets.buckets} == {1, 2, 4, 8}
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        t.window_flow.bucket(1, 251)
    with pytest.raises(ValueError, match="bounded flow window"):
        Token2Wav(t2w.flow, t2w.hift, bucketed=True)


def test_a_render_of_more_streams_than_its_bound_is_split_and_loses_nothing(t2w: Token2Wav,
                                                                             prompt: FlowPrompt) -> None:
    """max_render_streams 2: five streams' first chunks in one render call run as flow calls of
    2, 2 and 1 streams, and every stream gets its audio, equal to its render alone."""
    t = Token2Wav(t2w.flow, t2w.hift, max_render_streams=2)
    prompts = [prompt, *(_random_prompt(t2w, 20 + 9 * i, 20 + i) for i in range(4))]

    def first_chunks():
        chunks = []
        for i, p in enumerate(prompts):
            stream = t.stream(p, zero_noise=True)
            stream.add(_tokens(t2w, stream.tokens_for_next_chunk, 30 + i))
            chunks.append(stream.next_chunk())
        return chunks

    alone = [t.render([chunk])[0] for chunk in first_chunks()]
    sizes = []
    render = t.flow.render
    t.flow.render = lambda requests: (sizes.append(len(requests)), render(requests))[1]
    try:
        together = t.render(first_chunks())
    finally:
        del t.flow.render
    assert sizes == [2, 2, 1]
    assert len(together) == 5
    for a, b in zip(together, alone):
        assert a.shape == b.shape and max_error_to_peak(a, b) <= SPEECH


def test_a_bucketed_stream_holds_its_window_whatever_its_length(t2w: Token2Wav, prompt: FlowPrompt) -> None:
    """The state a bucketed stream holds is its window (left_chunks × 50 frames) from the first
    chunk to the last: the same bytes after 3 chunks and after 6."""
    t = _bucketed(t2w, left_chunks=2)
    stream = t.stream(prompt, zero_noise=True, mode="fast")
    stream.add(_tokens(t2w, 700, 9))
    held = []
    for _ in range(6):
        t.render([stream.next_chunk()])
        assert isinstance(stream.flow_cache, SlotState)
        held.append((stream.flow_cache.held, stream.flow_cache.nbytes()))
    assert held[2] == held[5] and held[5][0] == 100, held


def test_the_encoder_batched_over_streams_equals_each_alone(t2w: Token2Wav) -> None:
    """Flow.encode_streaming: token rows of different lengths, final (no held-back context) and not,
    padded to the longest: each row's mu within MEL of its `encode` alone."""
    flow, g = t2w.flow, torch.Generator().manual_seed(11)
    tokens = [torch.randint(0, flow.input_embedding.num_embeddings, (1, n), generator=g) for n in (53, 78, 12, 100)]
    finalize = [False, True, False, True]
    with torch.inference_mode():
        mu, ends = flow.encode_streaming(tokens, finalize)
        for b, (t, final) in enumerate(zip(tokens, finalize)):
            alone = flow.encode(t, final, True)[0]
            assert ends[b] == alone.shape[0]
            assert max_error_to_peak(mu[b, : ends[b]], alone) <= MEL, f"row {b}"


def _alone_chunks(t2w: Token2Wav, prompt: FlowPrompt, tokens: list[int]) -> list[torch.Tensor]:
    stream = t2w.stream(prompt, zero_noise=True, mode="fast")
    return stream.push(tokens) + [stream.finish()]


def _assert_equal_chunks(got: list[torch.Tensor], alone: list[torch.Tensor], name: str) -> None:
    assert [c.shape for c in got] == [c.shape for c in alone[: len(got)]], name
    errors = [max_error_to_peak(a, b) for a, b in zip(got, alone)]
    assert max(errors) <= SPEECH, f"{name}: max abs error per chunk, of its peak: {errors}"


def test_a_stream_owns_its_slot_until_its_last_chunk_and_the_next_stream_reuses_it(t2w: Token2Wav,
                                                                                    prompt: FlowPrompt) -> None:
    """max_streams 2: two open streams own both slots, a third is refused (SlotsExhausted, nothing
    taken); one stream's last chunk frees its slot and the next stream takes it, starting from its
    voice's prompt state, not the previous owner's window: its audio equals its own alone; a
    dropped stream object frees its slot too."""
    from voicebot.tts.cosyvoice2.flow_window import SlotsExhausted

    eager, t = Token2Wav(t2w.flow, t2w.hift, flow_left_chunks=1), _bucketed(t2w, max_streams=2)
    pool = t.window_flow.slots
    first, second = (t.stream(prompt, zero_noise=True, mode="fast") for _ in range(2))
    assert pool.free == 0 and {first.flow_cache.slot.index, second.flow_cache.slot.index} == {0, 1}
    with pytest.raises(SlotsExhausted):
        t.stream(prompt, zero_noise=True, mode="fast")
    assert pool.free == 0
    first.push(_tokens(t2w, 130, 40))
    first.finish()
    assert pool.free == 1 and not first.flow_cache
    voice, tokens = _random_prompt(t2w, 37, 41), _tokens(t2w, 160, 42)
    reused = t.stream(voice, zero_noise=True, mode="fast")
    assert reused.flow_cache.slot.index == 0 and pool.free == 0
    _assert_equal_chunks(reused.push(tokens) + [reused.finish()], _alone_chunks(eager, voice, tokens), "reused slot")
    del second
    assert pool.free == 2


def test_a_stream_closed_before_or_during_a_render_frees_its_slot_and_costs_the_others_nothing(
        t2w: Token2Wav, prompt: FlowPrompt) -> None:
    """Three streams render together; one is closed (its session cancelled, from the loop's thread)
    while their render runs: the render completes, the others' audio equals each alone, and its
    slot is free at once. Its next chunk, handed to a render after the close, renders nothing and
    is counted; a new stream takes its slot and renders beside the others, equal to itself alone."""
    eager, t = Token2Wav(t2w.flow, t2w.hift, flow_left_chunks=1), _bucketed(t2w, max_streams=3)
    pool = t.window_flow.slots
    voices = [prompt, _random_prompt(t2w, 37, 50), _random_prompt(t2w, 61, 51), _random_prompt(t2w, 23, 52)]
    tokens = [_tokens(t2w, 180, 60 + i) for i in range(4)]
    streams = [t.stream(v, zero_noise=True, mode="fast") for v in voices[:3]]
    for s, toks in zip(streams, tokens):
        s.add(toks)
        s.end()
    cancelled, kept = streams[0], streams[1:]
    render = t.window_flow.render

    def closing(requests):  # the close lands while the flow call runs
        cancelled.close()
        return render(requests)

    t.window_flow.render = closing
    try:
        first = t.render([s.next_chunk() for s in streams])
    finally:
        del t.window_flow.render
    assert all(a.shape[1] > 0 for a in first) and pool.free == 1 and not cancelled.flow_cache.slot.owned
    got = [[a] for a in first[1:]]
    stale = cancelled.next_chunk()
    audio = t.render([stale] + [s.next_chunk() for s in kept])
    assert audio[0].shape == (1, 0) and t.closed_chunks == 1
    for g, a in zip(got, audio[1:]):
        g.append(a)
    newcomer = t.stream(voices[3], zero_noise=True, mode="fast")
    assert newcomer.flow_cache.slot.index == cancelled.flow_cache.slot.index
    newcomer.add(tokens[3])
    newcomer.end()
    joined = []
    while requests := [(i, r) for i, s in enumerate([*kept, newcomer]) if (r := s.next_chunk()) is not None]:
        for (i, _), a in zip(requests, t.render([r for _, r in requests])):
            (got[i] if i < 2 else joined).append(a)
    for i, (g, voice, toks) in enumerate(zip(got, voices[1:3], tokens[1:3])):
        _assert_equal_chunks(g, _alone_chunks(eager, voice, toks), f"kept stream {i}")
    _assert_equal_chunks(joined, _alone_chunks(eager, voices[3], tokens[3]), "the stream in the freed slot")
    assert pool.free == 3


def test_a_render_calls_budget_in_audio_is_written_down(t2w: Token2Wav, prompt: FlowPrompt) -> None:
    """Token2Wav.render_budget: 8 streams' longest first chunks (a 25-token hop padded to 49, and 3
    lookahead: 104 frames, 2.08 s), 16.64 s; the longest chunk 206 frames, 4.12 s; a chunk's
    seconds are its tokens past its offset. The figures render_queue.py's tests use."""
    budget = Token2Wav(t2w.flow, t2w.hift, max_render_streams=8).render_budget()
    assert (budget.max_call_s, budget.longest_chunk_s) == pytest.approx((16.64, 4.12)) and not budget.padded
    assert _bucketed(t2w, max_render_streams=8).render_budget().padded
    assert Token2Wav(t2w.flow, t2w.hift, max_render_streams=1).render_budget().max_call_s == pytest.approx(4.12)
    stream = t2w.stream(prompt, zero_noise=True)
    stream.add(_tokens(t2w, 300, 70))
    first = stream.next_chunk()
    assert budget.seconds_of(first) == pytest.approx(first.n_tokens * 2 * 480 / 24000) and budget.seconds_of(first) <= 2.08
    t2w.render([first])
    second = stream.next_chunk()
    assert budget.seconds_of(second) == pytest.approx((second.n_tokens - second.offset) * 0.04)


def test_a_speech_jobs_close_frees_its_streams_slot_before_its_lm_slot(t2w: Token2Wav, prompt: FlowPrompt) -> None:
    """SpeechJob.close (a reply done or cancelled): the stream is closed and its flow slot free
    before the LM slot goes back, so the next stream that LM slot opens finds a flow slot."""
    from voicebot.tts.cosyvoice2.speech_job import PlaybackClock, SpeechJob

    t = _bucketed(t2w, max_streams=1)
    stream = t.stream(prompt, zero_noise=True, mode="fast")
    released = []

    class Scheduler:  # the one call close makes
        def release(self, row):
            released.append((row, t.window_flow.slots.free))

    SpeechJob(Scheduler(), "row", stream, PlaybackClock()).close()
    assert released == [("row", 1)] and stream.closed
