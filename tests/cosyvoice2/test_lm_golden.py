"""The LM against the official outputs (golden.safetensors "lm.*", golden_meta.json), loaded from the
fixture directory by the same loader as a real model, plus unit tests of the cache and samplers.

Max abs differences reached (fp32, 1 thread; README tolerance 1e-4 for logits): step logits
zero-shot 5.5e-6, cross-lingual 5.0e-6, bistream 1.1e-5; teacher-forced embeddings, hidden state
and logits 0 (bit-exact). Tokens (greedy, seeded RAS, bistream) and call schedules exact.

A greedy token is compared only where it is decided: each logit may be off by the logit bound, so a
step whose top-1/top-2 margin is within twice the bound is a near-tie that a correct fp32
implementation may take either way. Tokens must equal the official ones up to the first near-tie
at which they part (the test says so by a warning); logits and calls are compared up to that step.
The fixtures' smallest margins: zero-shot 0.019, cross-lingual 0.009, against a near-tie's 1.6e-3.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import Tensor

from golden_bounds import HALF_LOGITS, LOGITS, Margins, assert_close_to_peak, compared_steps

from voicebot.tts.cosyvoice2.bistream import Bistream
from voicebot.tts.cosyvoice2.hparams import load_hparams
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, Qwen2Config, build_lm_input, generate, run_alone
from voicebot.tts.cosyvoice2.loader import load_lm
from voicebot.tts.cosyvoice2.sampling import RasSampler, greedy



@pytest.fixture(scope="module")
def lm(cv2_dir: Path) -> CosyVoice2LM:
    return load_lm(cv2_dir)


@contextmanager
def recording(lm: CosyVoice2LM) -> Iterator[tuple[list[Tensor], list[list[int]]]]:
    """Capture llm_decoder outputs (raw step logits) and [new_len, past_len, mask_len] per forward."""
    logits: list[Tensor] = []
    calls: list[list[int]] = []
    hooks = [
        lm.llm_decoder.register_forward_hook(lambda m, args, out: logits.append(out.detach().clone())),
        lm.register_forward_hook(
            lambda m, args, out: calls.append([args[0].shape[1], int(args[1][0]), int(args[1][0]) + args[0].shape[1]])
        ),
    ]
    try:
        yield logits, calls
    finally:
        for h in hooks:
            h.remove()


def _check_logits(logits: list[Tensor], expected: Tensor, steps: int | None = None) -> None:
    """The first `steps` step logits (None: all of them) within the logit bound."""
    got = torch.cat(logits)
    if steps is None:
        assert got.shape == expected.shape
    assert_close_to_peak(got[:steps], expected[:steps], LOGITS, "step logits")


@pytest.mark.golden
@pytest.mark.parametrize("case", ["zero_shot", "cross_lingual"])
def test_greedy_decode_with_kv_cache(lm: CosyVoice2LM, cv2_golden: dict, cv2_meta: dict, case: str) -> None:
    g, meta = cv2_golden, cv2_meta[f"lm.{case}"]
    prompts = (g["lm.prompt_text"], g["lm.prompt_speech_token"]) if case == "zero_shot" else (None, None)
    sampler = Margins(greedy)
    with recording(lm) as (logits, calls):
        tokens = list(generate(lm, lm.new_cache(lm.cfg.max_position_embeddings), sampler, g["lm.text"], *prompts,
                               meta["min_token_text_ratio"], meta["max_token_text_ratio"]))
    expected = g[f"lm.{case}.step_logits"]
    steps = compared_steps(lm.speech_token_size, sampler, tokens, g[f"lm.{case}.greedy_tokens"].tolist(), expected)
    if steps is None:
        assert len(tokens) == meta["n_tokens"]
    _check_logits(logits, expected, steps)
    assert [c[:2] for c in calls[:steps]] == meta["forward_one_step_calls"][:steps]


@pytest.mark.golden
def test_teacher_forced(lm: CosyVoice2LM, cv2_golden: dict, cv2_meta: dict) -> None:
    g = cv2_golden
    embeds = g["lm.teacher_forced.lm_input_embeds"]
    seq_len = cv2_meta["lm.teacher_forced"]["seq_len"]
    assert embeds.shape[1] == seq_len
    with torch.inference_mode():
        built = build_lm_input(lm, g["lm.text"].long().flatten(), g["lm.prompt_text"].long().flatten(),
                               g["lm.teacher_forced.input_speech_tokens"].long().flatten())
        torch.testing.assert_close(built, embeds, atol=0, rtol=0)
        hidden = lm.qwen(embeds, torch.arange(seq_len), lm.new_cache(seq_len))
        logits = lm.llm_decoder(hidden)
    assert_close_to_peak(hidden, g["lm.teacher_forced.hidden"], LOGITS, "hidden")
    assert_close_to_peak(logits, g["lm.teacher_forced.logits"], LOGITS, "logits")


@pytest.mark.golden
def test_ras_seeded(lm: CosyVoice2LM, cv2_dir: Path, cv2_golden: dict, cv2_meta: dict) -> None:
    g, meta, ras = cv2_golden, cv2_meta["lm.zero_shot"], cv2_meta["lm.zero_shot.ras"]
    # replay: the official calls on the official sizes (the serving draw is the same distribution
    # with another random stream: test_lm_syncs.py).
    sampler = RasSampler.from_hparams(load_hparams(cv2_dir)["llm"]["sampling"],
                                      torch.Generator().manual_seed(ras["seed"]), replay=True)
    assert (sampler.top_p, sampler.top_k, sampler.win_size, sampler.tau_r) == tuple(ras["ras"].values())
    tokens = list(generate(lm, lm.new_cache(lm.cfg.max_position_embeddings), sampler, g["lm.text"], g["lm.prompt_text"],
                           g["lm.prompt_speech_token"], meta["min_token_text_ratio"], meta["max_token_text_ratio"]))
    assert tokens == g[f"lm.zero_shot.ras_seed{ras['seed']}_tokens"].tolist()


@pytest.mark.golden
def test_bistream(lm: CosyVoice2LM, cv2_golden: dict, cv2_meta: dict) -> None:
    g, meta = cv2_golden, cv2_meta["lm.bistream"]

    def capped_greedy(logp: Tensor, history: list[int]) -> int:
        # The fixture's sampler: greedy, but eos once `cap` outputs exist and eos is allowed.
        if len(history) >= meta["cap_forcing_eos_after_out_tokens"] and logp[lm.eos] != -float("inf"):
            return lm.eos
        return int(logp.argmax())

    sample = Margins(capped_greedy)

    cache = lm.new_cache(lm.cfg.max_position_embeddings)
    stream = Bistream(lm, cache.max_seq_len, g["lm.prompt_text"], g["lm.prompt_speech_token"])
    tokens: list[int] = []
    with recording(lm) as (logits, calls):
        for token in g["lm.bistream.text"].flatten():  # one text token at a time, as the frontend feeds
            tokens += run_alone(lm, cache, sample, stream.push(token.reshape(1, 1)))
        tokens += run_alone(lm, cache, sample, stream.finish())
    expected = g["lm.bistream.step_logits"]
    steps = compared_steps(lm.speech_token_size, sample, tokens, g["lm.bistream.yielded_tokens"].tolist(), expected)
    if steps is None:
        assert len(tokens) == meta["n_yielded"]
    assert calls[:steps] == meta["forward_one_step_calls"][:steps]
    _check_logits(logits, expected, steps)


@pytest.mark.golden
@pytest.mark.parametrize("pieces", [(2, 3, 7, 1, 12), (9,), (25,)])
def test_bistream_fed_in_pieces_takes_the_steps_of_one_token_at_a_time(lm: CosyVoice2LM, cv2_golden: dict,
                                                                      cv2_meta: dict, pieces: tuple[int, ...]) -> None:
    """Text pushed in pieces of several tokens (a word, a sentence) decodes every block it
    completes, as the official loop fed one token at a time does (test_bistream: the golden order):
    the same tokens from the same steps."""
    g, cap = cv2_golden, cv2_meta["lm.bistream"]["cap_forcing_eos_after_out_tokens"]
    text = g["lm.bistream.text"].flatten()

    def capped_greedy(logp: Tensor, history: list[int]) -> int:  # the golden's sampler
        return lm.eos if len(history) >= cap and logp[lm.eos] != -float("inf") else int(logp.argmax())

    def run(cuts: list[int]) -> tuple[list[int], list]:
        cache = lm.new_cache(lm.cfg.max_position_embeddings)
        stream = Bistream(lm, cache.max_seq_len, g["lm.prompt_text"], g["lm.prompt_speech_token"])
        tokens: list[int] = []
        with recording(lm) as (_, calls):
            start = 0
            for cut in cuts:
                tokens += run_alone(lm, cache, capped_greedy, stream.push(text[start : start + cut]))
                start += cut
            tokens += run_alone(lm, cache, capped_greedy, stream.finish())
        return tokens, calls

    cuts = [pieces[i % len(pieces)] for i in range(len(text))]
    while sum(cuts) > len(text):
        cuts[-1] -= min(cuts[-1], sum(cuts) - len(text))
        cuts = [c for c in cuts if c]
    assert run(cuts) == run([1] * len(text))


@pytest.mark.golden
def test_half_precision_tracks_fp32(cv2_dir: Path, cv2_golden: dict) -> None:
    """The CUDA default is float16; the same code runs on CPU (bound: golden_bounds.HALF_LOGITS)."""
    lm16 = load_lm(cv2_dir, dtype=torch.float16)
    embeds, expected = cv2_golden["lm.teacher_forced.lm_input_embeds"], cv2_golden["lm.teacher_forced.logits"]
    cache = lm16.new_cache(embeds.shape[1])
    assert cache.k.dtype == torch.float16
    with torch.inference_mode():
        logits = lm16.llm_decoder(lm16.qwen(embeds.half(), torch.arange(embeds.shape[1]), cache)).float()
    assert_close_to_peak(logits, expected, HALF_LOGITS, "float16 logits")


def _tiny_lm(vocab: int = 32, speech: int = 16) -> CosyVoice2LM:
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, rope_theta=1e4, rms_norm_eps=1e-6,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    return CosyVoice2LM(cfg, speech).eval()


def test_generation_stops_at_cache_end_and_rejects_a_too_small_cache() -> None:
    lm = _tiny_lm()
    text = list(range(4))
    never_stop = lambda logp, history: 0  # noqa: E731
    # prefix = sos + 4 text + task_id = 6 positions; a 10-slot cache holds 5 decode steps.
    assert len(list(generate(lm, lm.new_cache(10), never_stop, text, min_token_text_ratio=0))) == 5
    with pytest.raises(ValueError, match="split the text"):
        list(generate(lm, lm.new_cache(10), never_stop, text))


def test_static_cache_decode_equals_full_forward() -> None:
    lm = _tiny_lm()
    x = torch.randn(1, 7, 16)
    with torch.inference_mode():
        full = lm.qwen(x, torch.arange(7), lm.new_cache(7))
        cache = lm.new_cache(32)
        steps = [lm.qwen(x[:, :4], torch.arange(4), cache)]
        steps += [lm.qwen(x[:, i : i + 1], torch.tensor([i]), cache) for i in range(4, 7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-6, rtol=0)
    assert cache.nbytes() == 2 * cache.k.numel() * 4 == 2 * (1 * 1 * 1 * 32 * 8) * 4  # [layers, B, kv, S, hd] fp32


def test_ras_nucleus_keeps_the_candidate_that_crosses_top_p() -> None:
    probs = torch.tensor([0.5, 0.29, 0.2, 0.01])
    seen = {RasSampler(top_p=0.8, generator=torch.Generator().manual_seed(s))(probs.log(), []) for s in range(200)}
    assert seen == {0, 1, 2}  # 0.5 + 0.29 < 0.8, so id 2 is kept; id 3 never is


def test_ras_repeat_falls_back_to_the_full_distribution_without_the_repeated_id() -> None:
    logp = torch.tensor([0.97, 0.01, 0.01, 0.01]).log()
    sampler = RasSampler(top_k=1, generator=torch.Generator().manual_seed(0))
    assert sampler(logp, [3]) == 0
    assert {sampler(logp, [0]) for _ in range(50)} == {1, 2, 3}


def test_a_greedy_token_may_part_from_the_official_one_only_at_a_near_tie() -> None:
    """compared_steps (golden_bounds.py) on made-up steps over 4 ids (3 is the fill, not yielded):
    logits peak 10, so a near-tie is a margin ≤ 2 × LOGITS × 10."""
    tie = 2 * LOGITS * 10
    steps = [torch.tensor([1.0, 0.0, -9.0, -9.0]), torch.tensor([0.0, 0.0, -9.0, 9.0]),  # id 0; the fill
             torch.tensor([0.0, -tie / 2, -9.0, -9.0]), torch.tensor([-1.0, 0.0, -9.0, -9.0])]
    logits = torch.full((4, 4), 10.0)
    sampler = Margins(greedy)
    tokens = [t for t in (sampler(logp, []) for logp in steps) if t < 3]
    assert tokens == [0, 0, 1]
    with pytest.warns(UserWarning, match=r"near-tie steps \[2\]"):
        assert compared_steps(3, sampler, tokens, [0, 0, 1], logits) is None  # equal: everything compares
    with pytest.warns(UserWarning):
        assert compared_steps(3, sampler, tokens, [0, 1, 0], logits) == 3  # parted at the near-tie (step 2)
    with pytest.warns(UserWarning), pytest.raises(AssertionError, match="token 2 .step 3"):
        compared_steps(3, sampler, tokens, [0, 0, 0], logits)  # parted where the margin was 1
