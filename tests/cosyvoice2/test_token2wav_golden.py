"""Token → wave through the official wrapper's paths (CosyVoice2Model.tts), HiFT noise zeroed.

The stream test records every flow and HiFT call of the official recompute algorithm and checks
it against golden_meta.json's `tts.stream.calls` and the per-call tensors. Max errors reached
(fp32, 1 thread, tiny fixtures): nonstream speech 4.0e-5; stream chunks 1.4e-5; per-call mels
2.6e-6, sources 0 (bit-exact). The `exact` mode (cached flow) yields the same chunks.
"""

from __future__ import annotations


import pytest
import torch

from golden_bounds import MEL, SOURCE, SPEECH, assert_close_to_peak
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav

pytestmark = pytest.mark.golden


def _record_calls(t2w: Token2Wav, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Wrap the flow and HiFT of `t2w` so that each call is logged in golden_meta's format: a
    flow call per rendered request, a HiFT call per chunk (its excitation, then its decode)."""
    calls: list[dict] = []
    flow_render, excitations, decode_batch = t2w.flow.render, t2w.hift.excitations, t2w.hift.decode_batch

    def flow_call(requests):
        mels = flow_render(requests)
        for r, mel in zip(requests, mels):
            calls.append({"call": "flow", "token_len": r.token.shape[1], "streaming": r.streaming,
                          "finalize": r.finalize, "mel_frames": mel.shape[2], "mel_full": mel})
        return mels

    def excitations_call(requests):
        made = excitations(requests)
        for r, (source, _) in zip(requests, made):
            n_cache = 0 if r.head is None else r.head.shape[2]
            calls.append({"call": "hift", "mel_in_frames": r.f0_mel.shape[2], "cache_source_len": n_cache,
                          "mel_in": r.f0_mel, "cache_source_in": r.head, "source": source})
        return made

    def decode_call(mels, sources):
        speeches = decode_batch(mels, sources)
        decoding = [c for c in calls if c["call"] == "hift" and "speech" not in c]
        assert len(decoding) == len(speeches)
        for call, speech in zip(decoding, speeches):
            call.update(speech_len=speech.shape[1], speech=speech)
        return speeches

    monkeypatch.setattr(t2w.flow, "render", flow_call)
    monkeypatch.setattr(t2w.hift, "excitations", excitations_call)
    monkeypatch.setattr(t2w.hift, "decode_batch", decode_call)
    return calls


def test_nonstream(cv2_golden: dict, t2w: Token2Wav, prompt: FlowPrompt) -> None:
    speech = t2w.full(cv2_golden["flow.token"], prompt, zero_noise=True)
    assert_close_to_peak(speech, cv2_golden["tts.nonstream.speech"], SPEECH)


def test_stream_one_token_at_a_time(cv2_golden: dict, cv2_meta: dict, t2w: Token2Wav, prompt: FlowPrompt,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    meta = cv2_meta["tts.stream"]
    calls = _record_calls(t2w, monkeypatch)
    stream = t2w.stream(prompt, zero_noise=True, mode="recompute")
    chunks = []
    for token in cv2_golden["flow.token"][0].tolist():
        chunks += stream.push([token])
    chunks.append(stream.finish())

    assert [{k: v for k, v in c.items() if not isinstance(v, torch.Tensor | None)} for c in calls] == [
        {**c, "call": c["call"].rstrip("0123456789")} for c in meta["calls"]
    ]
    for logged, expected in zip(calls, meta["calls"]):
        name = f"tts.stream.{expected['call']}"
        if logged["call"] == "flow":
            assert_close_to_peak(logged["mel_full"], cv2_golden[f"{name}.mel_full"], MEL)
            continue
        assert_close_to_peak(logged["mel_in"], cv2_golden[f"{name}.mel_in"], MEL)
        if logged["cache_source_len"]:
            assert_close_to_peak(logged["cache_source_in"], cv2_golden[f"{name}.cache_source_in"], SOURCE)
        assert_close_to_peak(logged["source"], cv2_golden[f"{name}.source"], SOURCE)
        assert_close_to_peak(logged["speech"], cv2_golden[f"{name}.speech"], SPEECH)

    # Chunk causality, which a cached flow (no prefix recompute) relies on: a later non-final
    # call reproduces the frames of earlier ones.
    flows = [c for c in calls if c["call"] == "flow" and not c["finalize"]]
    for earlier, later in zip(flows, flows[1:]):
        n = earlier["mel_frames"]
        assert_close_to_peak(later["mel_full"][:, :, :n], earlier["mel_full"], MEL)

    assert [c.shape[1] for c in chunks] == meta["chunk_speech_lens"]
    assert sum(c.shape[1] for c in chunks) == meta["total"]
    for i, chunk in enumerate(chunks):
        assert_close_to_peak(chunk, cv2_golden[f"tts.stream.chunk{i}.speech"], SPEECH)


@pytest.mark.parametrize("push_size", [1, 7, 200])
def test_stream_exact_mode(cv2_golden: dict, cv2_meta: dict, golden_stream, push_size: int) -> None:
    """The cached flow (no prefix recompute) yields the official chunks."""
    chunks = golden_stream("exact", push_size)
    assert [c.shape[1] for c in chunks] == cv2_meta["tts.stream"]["chunk_speech_lens"]
    for i, chunk in enumerate(chunks):
        assert_close_to_peak(chunk, cv2_golden[f"tts.stream.chunk{i}.speech"], SPEECH)


def test_second_stream_starts_from_the_first_hop(cv2_golden: dict, cv2_meta: dict, t2w: Token2Wav,
                                                 prompt: FlowPrompt) -> None:
    """The official wrapper keeps the grown hop on the model; ours restarts it for every request.
    All tokens are pushed at once here: the chunking must not depend on how tokens arrive."""
    tokens = cv2_golden["flow.token"][0].tolist()
    for _ in range(2):
        stream = t2w.stream(prompt, zero_noise=True)
        chunks = stream.push(tokens) + [stream.finish()]
        assert [c.shape[1] for c in chunks] == cv2_meta["tts.stream"]["chunk_speech_lens"]
    assert_close_to_peak(chunks[0], cv2_golden["tts.stream.chunk0.speech"], SPEECH)


def test_utterance_shorter_than_the_first_hop_is_one_full_chunk(cv2_golden: dict, t2w: Token2Wav,
                                                                prompt: FlowPrompt) -> None:
    stream = t2w.stream(prompt, zero_noise=True)
    tokens = cv2_golden["flow.token"][:, : stream.tokens_for_next_chunk - 1]
    assert stream.push(tokens[0].tolist()) == []
    torch.testing.assert_close(stream.finish(), t2w.full(tokens, prompt, zero_noise=True), rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        stream.push([0])
