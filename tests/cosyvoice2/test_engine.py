"""The CosyVoice 2 Synthesizer on the tiny fixture model (tokenizer and ONNX stand-ins built here)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch
from pydantic import ValidationError

from golden_bounds import SPEECH, assert_close_to_peak
from tiny_frontend import make_model_dir
from voicebot.config.engines import Cosyvoice2Config
from voicebot.tts.base import SAMPLE_RATE
from voicebot.serving import render_queue
from voicebot.tts.cosyvoice2 import synthesizer as synthesizer_mod
from voicebot.tts.cosyvoice2 import lm as lm_mod
from voicebot.tts.cosyvoice2.bistream import Bistream
from voicebot.tts.cosyvoice2.bistream_text import WordFeed
from voicebot.tts.cosyvoice2.synthesizer import CosyVoice2Synthesizer
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt
from voicebot.tts.cosyvoice2.voice_prompts import flow_prompt
from voicebot.tts.cosyvoice2.lm import generate, run_alone
from voicebot.tts.cosyvoice2.quant import DynamicInt8Linear

SAMPLES_PER_TOKEN = 2 * 480  # two mel frames of 480 samples
N_TOKENS = 60  # speech tokens per utterance with the fixed-length sampler


@pytest.fixture
def fixed_length(monkeypatch, synth):
    """Random tiny weights may sample a stop id at once; this sampler decodes exactly N_TOKENS
    (arg-max over the speech ids, then eos) so the audio length is known."""
    eos = synth.lm.eos

    def sample(logp, history):
        return int(logp[:eos].argmax()) if len(history) < N_TOKENS else eos

    monkeypatch.setattr(synthesizer_mod.RasSampler, "from_hparams", lambda *args: sample)


def test_reported_attention_is_the_one_the_lm_calls(synth, monkeypatch):
    calls = []
    sdpa = lm_mod.F.scaled_dot_product_attention
    monkeypatch.setattr(lm_mod.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    with torch.inference_mode():
        synth.lm(synth.lm.speech_embedding.weight[:1].reshape(1, 1, -1), torch.tensor([0]), synth.lm.new_cache(64))
    assert len(calls) == synth.lm.cfg.num_hidden_layers and synth.info().details["attention"] == "sdpa"


def make_synth(root: Path, cv2_dir: Path, **config: Any) -> CosyVoice2Synthesizer:
    """A loaded engine on the tiny model with one wav voice, "anna"; `config` overrides fields."""
    voices = root / "voices"
    voices.mkdir()
    t = np.arange(2 * 24000) / 24000  # 2 s: 50 prompt tokens, one flow chunk the prompt state can keep
    sf.write(voices / "anna.wav", (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24000, subtype="FLOAT")
    (voices / "anna.txt").write_text("Hello world.")
    config = Cosyvoice2Config(model=str(make_model_dir(root / "model", cv2_dir)), voices_dir=voices,
                              voice_cache_dir=root / "cache", device="cpu", dtype="auto", kv_cache_tokens=512,
                              **config)
    engine = CosyVoice2Synthesizer(config, default_voice="anna")
    engine.load()
    return engine


@pytest.fixture(scope="module")
def synth(tmp_path_factory, cv2_dir) -> CosyVoice2Synthesizer:
    engine = make_synth(tmp_path_factory.mktemp("cv2"), cv2_dir)
    yield engine
    engine.close()


async def _deltas(text: str, size: int = 3):
    for i in range(0, len(text), size):
        yield text[i : i + size]
        await asyncio.sleep(0)


def test_load_lists_voices_and_reports(synth):
    names = [v.name for v in synth.voices()]
    assert names[-1] == "anna" and "tiny_zero_shot_spk" in names and "微型说话人" in names
    info = synth.info()
    # "auto" in the config resolves to float32 on CPU.
    assert info.loaded and info.device == "cpu" and info.details["dtype"] == "float32"
    assert info.details["attention"] == "sdpa" and info.details["voice_state_bytes"] > 0
    # The default voice's flow prompt state was computed at load, before any reply.
    assert info.details["stream_mode"] == "fast" and info.details["flow_prompt_state_bytes"] > 0
    with pytest.raises(KeyError):
        synth.open("nobody")


@pytest.fixture
def sentences_mode(monkeypatch, synth):
    """One official unistream request per sentence instead of the default bistream."""
    monkeypatch.setattr(synth.config, "text_input", "sentences")


@pytest.mark.parametrize("voice", ["anna", "tiny_zero_shot_spk", "tiny_sft_spk"])
def test_stream_yields_24k_float32_per_sentence(synth, voice, fixed_length, sentences_mode):
    async def run():
        context = synth.open(voice)
        chunks = [c async for c in context.stream(_deltas("Hello world. This is a test of the tokenizer!"))]
        await context.close()
        return chunks

    chunks = asyncio.run(run())
    assert chunks and all(c.audio.dtype == np.float32 and c.audio.ndim == 1 for c in chunks)
    assert [c.segment for c in chunks] == sorted(c.segment for c in chunks)
    texts = {c.segment: c.text for c in chunks}
    assert texts == {0: "Hello world.", 1: "This is a test of the tokenizer!"}
    for segment in texts:
        # Streaming yields exactly the utterance's audio, two 480-sample frames per speech token,
        # in more than one chunk (the first after 25 + pad + 3 tokens).
        audio = [c.audio for c in chunks if c.segment == segment]
        assert sum(map(len, audio)) == N_TOKENS * SAMPLES_PER_TOKEN and len(audio) >= 2
    assert max(np.abs(c.audio).max() for c in chunks) <= 0.99
    assert SAMPLE_RATE == synth.hparams["sample_rate"]


def run_bistream_directly(synth, voice_name: str, sentences: list[str], seed: int) -> tuple[list[int], np.ndarray]:
    """What the engine should produce: its sentences pushed into Bistream, the tokens through Token2WavStream."""
    voice, frontend = synth.library[voice_name], synth.library.frontend.text
    generator = torch.Generator().manual_seed(seed)
    sampler = synthesizer_mod.RasSampler.from_hparams(synth.hparams["llm"]["sampling"], generator)
    cache = synth.lm.new_cache(synth.config.kv_cache_tokens)
    lm = Bistream(synth.lm, cache.max_seq_len, voice.prompt_text, voice.lm_prompt_speech)
    tokens = []
    for i, sentence in enumerate(sentences):
        tokens += run_alone(synth.lm, cache, sampler, lm.push(frontend.encode((" " if i else "") + frontend.normalize(sentence))))
    tokens += run_alone(synth.lm, cache, sampler, lm.finish())
    stream = synth.token2wav.stream(
        FlowPrompt(voice.flow_prompt_speech, voice.prompt_feat, voice.embedding), generator=generator
    )
    return tokens, torch.cat([*stream.push(tokens), stream.finish()], dim=1)[0].numpy()


def test_bistream_reply_is_one_segment_with_the_model_run_directly(synth, fixed_length):
    text = "Hello world. This is test 3 of the tokenizer!"  # the LM reads "three", the text keeps "3"

    async def run():
        context = synth.open("tiny_zero_shot_spk")
        context.generator.manual_seed(7)
        chunks = [c async for c in context.stream(_deltas(text))]
        await context.close()
        return chunks

    chunks = asyncio.run(run())
    assert {c.segment for c in chunks} == {0} and chunks[-1].text == text and len(chunks) >= 2
    tokens, direct = run_bistream_directly(synth, "tiny_zero_shot_spk", ["Hello world.", "This is test 3 of the tokenizer!"], 7)
    assert len(tokens) > 25 and sum(len(c.audio) for c in chunks) == len(tokens) * SAMPLES_PER_TOKEN
    assert_close_to_peak(torch.from_numpy(np.concatenate([c.audio for c in chunks])), torch.from_numpy(direct), SPEECH)


@pytest.mark.parametrize("size", [1, 3, 7, 100])
def test_word_feed_gives_out_complete_words_and_each_sentence_s_rest(size):
    text = "Hello world, this is test 3. How are you?  Fine!"
    feed, pieces = WordFeed(), []
    for i in range(0, len(text), size):
        pieces += feed.push(text[i : i + size])
    pieces += feed.flush()
    assert "".join(p for p, _ in pieces) == text  # nothing lost, nothing twice
    assert [p[-1] for p, end in pieces if end] == [".", "?", "!"]  # each sentence's rest ends it
    words = [p for p, end in pieces if not end]
    assert all(text.count(p) and (p.startswith(" ") or p == "Hello") for p in words)  # the space before goes with it
    if size == 1:
        assert [p for p, _ in pieces][:3] == ["Hello", " world,", " this"]
    zh = WordFeed()
    out = [p for ch in "你好，世界。今天天气很好，" for p in zh.push(ch)] + zh.flush()
    assert out == [("你好，", False), ("世界。", True), ("今天天气很好，", False), ("", True)]  # a clause at a time


@pytest.mark.parametrize("voice", ["tiny_sft_spk", "anna"])
def test_bistream_speaks_before_the_first_sentence_ends(synth, monkeypatch, voice):
    """Text goes into the LM a word at a time, so the first speech token comes after the first few
    words (5 text tokens after the voice's prompt speech is interleaved: official bistream), not
    after the first sentence; and the tokens equal the model fed one token at a time (the official
    order, test_lm_golden.py). A deterministic sampler: the session's generator also draws the
    vocoder's noise, between the LM's draws."""
    eos = synth.lm.eos

    def sampler(logp, history):  # arg-max over the speech ids; eos where allowed once 60 are out
        return eos if len(history) >= 60 and logp[eos] > -math.inf else int(logp[:eos].argmax())

    monkeypatch.setattr(synthesizer_mod.RasSampler, "from_hparams", lambda *args: sampler)
    words = ("This is the first sentence of a reply, and it goes on for quite a while with many more "
             "words before it ever comes to its end.").split(" ")
    text = " ".join(words)
    added: list[int] = []
    original_add = synthesizer_mod.Token2WavStream.add
    monkeypatch.setattr(synthesizer_mod.Token2WavStream, "add",
                        lambda stream, tokens: added.extend(tokens) or original_add(stream, tokens))
    before_the_end: list[int] = []

    async def deltas():
        for i, word in enumerate(words):
            if i == len(words) - 1:
                before_the_end.append(len(added))  # speech tokens out before the sentence's last word
            yield (" " if i else "") + word
            await asyncio.sleep(0)

    async def run():
        context = synth.open(voice)
        context.generator.manual_seed(3)
        chunks = [c async for c in context.stream(deltas())]
        await context.close()
        return chunks

    chunks = asyncio.run(run())
    assert before_the_end[0] > 0 and chunks[-1].text == text
    frontend = synth.library.frontend.text
    ids = [t for piece in [words[0], *(" " + frontend.normalize(w) for w in words[1:])] for t in frontend.encode(piece)]
    assert ids == frontend.encode(frontend.normalize(text))  # word by word, the sentence's tokens
    v = synth.library[voice]
    stream = Bistream(synth.lm, synth.config.kv_cache_tokens, v.prompt_text, v.lm_prompt_speech)
    cache = synth.lm.new_cache(synth.config.kv_cache_tokens)
    direct = [t for i in ids for t in run_alone(synth.lm, cache, sampler, stream.push([i]))]
    direct += run_alone(synth.lm, cache, sampler, stream.finish())
    assert added == direct


def test_bistream_starts_a_new_request_when_one_is_full(synth, fixed_length, monkeypatch):
    monkeypatch.setattr(synth.library.frontend.text, "token_min_n", 1)  # every sentence fills a request

    async def run():
        context = synth.open("anna")
        chunks = [c async for c in context.stream(_deltas("Hello world. This is a test. Goodbye now!"))]
        await context.close()
        return chunks

    chunks = asyncio.run(run())
    texts = {c.segment: c.text for c in chunks}
    assert texts == {0: "Hello world.", 1: "This is a test.", 2: "Goodbye now!"}


def decode_steps(synth) -> int:
    return sum(synth.scheduler.batch_sizes.values())


def all_slots_free(synth, timeout: float = 5.0) -> bool:
    """Releases reach the scheduler thread asynchronously: wait (bounded) for them to be applied."""
    deadline = time.monotonic() + timeout
    while synth.scheduler.pool.free != synth.config.batch_slots and time.monotonic() < deadline:
        time.sleep(0.01)
    return synth.scheduler.pool.free == synth.config.batch_slots


def test_nothing_to_say_yields_nothing(synth):
    steps = decode_steps(synth)

    async def run():
        context = synth.open()
        out = [c async for c in context.stream(_deltas("... !?"))]
        with pytest.raises(KeyError):
            context.set_voice("nobody")
        await context.close()
        return out

    assert asyncio.run(run()) == []
    assert decode_steps(synth) == steps and all_slots_free(synth)  # no LM work


def test_cancel_stops_work_promptly_and_frees_the_slot(synth, fixed_length):
    async def run():
        context = synth.open()
        stream = context.stream(_deltas("Hello world, one two three, this is a tiny test of the tokenizer. " * 3))
        first = await anext(stream)
        await stream.aclose()  # the consumer (barge-in) stops iterating
        await asyncio.sleep(0.2)
        after_cancel = decode_steps(synth)
        await asyncio.sleep(0.2)
        assert decode_steps(synth) == after_cancel and synth.scheduler.pending == 0
        assert all_slots_free(synth)
        # The session is still usable after a cancelled reply.
        again = [c async for c in context.stream(_deltas("Hi there."))]
        await context.close()
        return first, again

    first, again = asyncio.run(run())
    assert first.audio.size and again


def test_sessions_decode_in_one_batch(synth, fixed_length):
    synth.scheduler.batch_sizes.clear()

    async def one(voice):
        context = synth.open(voice)
        out = [c async for c in context.stream(_deltas("Hello world, this is a test."))]
        await context.close()
        return out

    async def run():
        return await asyncio.gather(one("anna"), one("tiny_zero_shot_spk"), one("anna"))

    assert all(asyncio.run(run()))
    assert max(synth.scheduler.batch_sizes) >= 2  # rows of several sessions in one forward
    assert synth.info().details["scheduler"]["batch_sizes"] == dict(sorted(synth.scheduler.batch_sizes.items()))


def test_reset_swaps_in_a_voice_state_derived_off_the_scheduler(synth, fixed_length, sentences_mode, monkeypatch):
    derived_on = []
    original = synth.voice_prompts.derive
    monkeypatch.setattr(synth.voice_prompts, "derive", lambda name: derived_on.append(threading.current_thread().name) or original(name))

    async def run():
        a, b = synth.open("anna"), synth.open("anna")
        [c async for c in a.stream(_deltas("Hello world."))]
        voice = synth.library["anna"]
        prefix = synth.voice_prompts.lm_prefix(voice)
        flow_state = synth.token2wav.prompt_state(flow_prompt(voice, synth.device, synth.dtype))
        reports = await asyncio.gather(a.reset(), b.reset())  # two sessions of one voice: one derivation
        assert [r.generation for r in reports] == [1, 1] and derived_on == ["worker-cosyvoice2-voices_0"]
        assert sorted(r.bytes_freed for r in reports)[0] == 0 and max(r.bytes_freed for r in reports) >= voice.nbytes()
        # Every part of the voice's state is new, with the same values: the source is unchanged.
        fresh = synth.library["anna"]
        assert fresh is not voice and fresh.prompt_feat.data_ptr() != voice.prompt_feat.data_ptr()
        assert synth.voice_prompts._lm_prefixes["anna"][0] is fresh
        new_prefix = synth.voice_prompts.lm_prefix(fresh)
        assert new_prefix.k.data_ptr() != prefix.k.data_ptr()
        torch.testing.assert_close(new_prefix.k, prefix.k, rtol=0, atol=0)
        fresh_prompt = flow_prompt(fresh, synth.device, synth.dtype)
        new_state = synth.token2wav.prompt_state(fresh_prompt)
        assert new_state is not flow_state and new_state.n_frames == flow_state.n_frames > 0
        assert new_state.steps[0].keys[0].data_ptr() != flow_state.steps[0].keys[0].data_ptr()
        assert (await a.reset()).generation == 2
        out = [c async for c in a.stream(_deltas("Hello world."))]
        await a.close()
        await b.close()
        assert a not in synth.contexts
        return out

    assert asyncio.run(run())


def test_engine_audio_equals_the_model_run_directly(synth, fixed_length, sentences_mode, monkeypatch):
    """The wiring: the same voice prompt, text ids and noise seed through generate + Token2WavStream.
    The engine starts the LM from the voice's cached prompt prefix; run directly, it prefills all."""
    text = "Hello world."
    prefixes = []
    original_unistream = synthesizer_mod.unistream
    monkeypatch.setattr(synthesizer_mod, "unistream", lambda *a, **k: prefixes.append(k.get("prefix")) or original_unistream(*a, **k))

    async def run():
        context = synth.open("tiny_zero_shot_spk")
        context.generator.manual_seed(7)
        out = [c.audio async for c in context.stream(_deltas(text))]
        await context.close()
        return np.concatenate(out)

    streamed = asyncio.run(run())

    voice = synth.library["tiny_zero_shot_spk"]
    ids = synth.library.frontend.text.encode(synth.library.frontend.text.normalize(text))
    generator = torch.Generator().manual_seed(7)
    sampler = synthesizer_mod.RasSampler.from_hparams(synth.hparams["llm"]["sampling"], generator)
    tokens = list(generate(synth.lm, synth.lm.new_cache(synth.config.kv_cache_tokens), sampler, ids, voice.prompt_text,
                           voice.lm_prompt_speech))
    stream = synth.token2wav.stream(
        FlowPrompt(voice.flow_prompt_speech, voice.prompt_feat, voice.embedding), generator=generator
    )
    direct = torch.cat([*stream.push(tokens), stream.finish()], dim=1)[0].numpy()
    assert len(tokens) == N_TOKENS
    assert_close_to_peak(torch.from_numpy(streamed), torch.from_numpy(direct), SPEECH)
    # the prefix was used, and it is the voice's one cached copy
    assert prefixes == [synth.voice_prompts.lm_prefix(voice)] and prefixes[0].length == 1 + voice.prompt_text.shape[1] > 1
    assert synth.info().details["lm_prefix_bytes"] >= prefixes[0].nbytes()


def test_first_chunk_leaves_as_soon_as_its_tokens_exist(synth, fixed_length, monkeypatch):
    seen = []  # (tokens decoded, tokens the chunk needs) per chunk rendered
    original = synth.token2wav.render

    def spy(chunks):
        seen.extend((len(c.stream.tokens), c.n_tokens) for c in chunks)
        return original(chunks)

    monkeypatch.setattr(synth.token2wav, "render", spy)

    async def run():
        context = synth.open("anna")
        [c async for c in context.stream(_deltas("Hello world."))]
        await context.close()

    asyncio.run(run())
    decoded, needed = seen[0]
    assert decoded == needed  # no LM step was spent past the chunk boundary before its audio


def test_int8_lm_engine_streams(tmp_path, cv2_dir, monkeypatch):
    eos = None

    def sample(logp, history):  # as the fixed_length fixture, for this engine's LM
        return int(logp[:eos].argmax()) if len(history) < N_TOKENS else eos

    monkeypatch.setattr(synthesizer_mod.RasSampler, "from_hparams", lambda *args: sample)
    engine = make_synth(tmp_path, cv2_dir, lm_int8=True)
    eos = engine.lm.eos

    async def run():
        context = engine.open("anna")
        chunks = [c.audio async for c in context.stream(_deltas("Hello world."))]
        await context.close()
        return chunks

    try:
        chunks = asyncio.run(run())
    finally:
        engine.close()
    assert engine.info().details["lm_int8"] is True
    assert isinstance(engine.lm.qwen.layers[0].self_attn.q_proj, DynamicInt8Linear)
    assert sum(map(len, chunks)) == N_TOKENS * SAMPLES_PER_TOKEN and np.isfinite(np.concatenate(chunks)).all()


def test_a_flow_window_in_the_config_bounds_what_the_renderer_keeps(tmp_path, cv2_dir, monkeypatch):
    """tts.cosyvoice2.flow_left_chunks reaches Token2Wav: a reply streams whole, each flow cache it
    leaves holds at most its own chunk and the window's (tests/cosyvoice2/test_flow_window.py: what
    the window keeps)."""
    eos = None

    def sample(logp, history):  # as the fixed_length fixture, for this engine's LM
        return int(logp[:eos].argmax()) if len(history) < N_TOKENS else eos

    monkeypatch.setattr(synthesizer_mod.RasSampler, "from_hparams", lambda *args: sample)
    engine = make_synth(tmp_path, cv2_dir, flow_left_chunks=1)
    eos = engine.lm.eos

    async def run():
        context = engine.open("anna")
        chunks = [c.audio async for c in context.stream(_deltas("Hello world."))]
        await context.close()
        return chunks

    try:
        chunks = asyncio.run(run())
    finally:
        engine.close()
    assert engine.token2wav.flow_left_chunks == 1
    assert sum(map(len, chunks)) == N_TOKENS * SAMPLES_PER_TOKEN and np.isfinite(np.concatenate(chunks)).all()
    with pytest.raises(ValidationError):
        Cosyvoice2Config(flow_left_chunks=-2)


@pytest.mark.parametrize("device, dtype", [("cuda", "auto"), ("auto", "auto"), ("cpu", "float16")])
def test_int8_lm_is_refused_off_cpu_float32(device, dtype):
    with pytest.raises(ValidationError, match="lm_int8 needs device: cpu"):
        Cosyvoice2Config(lm_int8=True, device=device, dtype=dtype)


# --- the same output in a batch as alone


async def _reply(synth, voice: str, seed: int, text: str, started: asyncio.Event | None = None,
                 after: asyncio.Event | None = None, cancel_after: int | None = None) -> np.ndarray:
    """One session's reply audio, seeded: it starts once `after` is set, sets `started` at its first
    chunk, and stops iterating (barge-in) after `cancel_after` chunks."""
    if after is not None:
        await after.wait()
    context = synth.open(voice)
    context.generator.manual_seed(seed)
    audio = []
    async with contextlib.aclosing(context.stream(_deltas(text))) as chunks:
        async for chunk in chunks:
            audio.append(chunk.audio)
            if started is not None:
                started.set()
            if cancel_after is not None and len(audio) >= cancel_after:
                break
    await context.close()
    return np.concatenate(audio)


# voice, seed, text: three prompt lengths (50 prompt tokens, the fixture's, none). The seeds give a
# long reply to a and a short one to d (sentences mode: 83, 32, 47 and 14 tokens), so that b and d
# join while a still decodes.
REPLIES = {
    "a": ("anna", 7, "Hello world, this is a test of the tokenizer."),
    "b": ("tiny_zero_shot_spk", 2, "This is test three of the tokenizer, hello!"),
    "c": ("anna", 3, "One two three, this is a tiny test of the tokenizer. " * 2),
    "d": ("tiny_sft_spk", 4, "Hi there, world."),
}


@pytest.mark.parametrize("text_input", ["bistream", "sentences"])
def test_a_session_in_a_batch_sounds_as_it_does_alone(synth, monkeypatch, text_input):
    """Real RAS sampling, each session its own seed. Together: a and c start at once, c is cancelled
    after its first chunk (leaves mid-reply), b joins at a's first chunk, d (no prompt, short) joins
    with b and leaves first. Each audio equals that session's reply run alone, LM steps and flow/HiFT
    chunks shared with the others."""
    monkeypatch.setattr(synth.config, "text_input", text_input)
    alone = {key: asyncio.run(_reply(synth, *spec)) for key, spec in REPLIES.items() if key != "c"}
    synth.scheduler.batch_sizes.clear()
    synth.scheduler.renders.sizes.clear()
    # Every chunk waits for company, up to 40 steps, whatever its listener's slack: the sessions'
    # chunk boundaries fall many steps apart, and renders of several sessions are what is tested.
    monkeypatch.setattr(synth.scheduler.renders, "hold_steps", 40)
    monkeypatch.setattr(render_queue, "RENDER_MARGIN_S", -math.inf)

    async def together():
        a_started = asyncio.Event()
        return await asyncio.gather(
            _reply(synth, *REPLIES["a"], started=a_started),
            _reply(synth, *REPLIES["b"], after=a_started),
            _reply(synth, *REPLIES["c"], cancel_after=1),
            _reply(synth, *REPLIES["d"], after=a_started),
        )

    a, b, c, d = asyncio.run(together())
    assert max(synth.scheduler.batch_sizes) >= 3, synth.scheduler.batch_sizes  # they did share LM steps
    assert max(synth.scheduler.renders.sizes) >= 2, synth.scheduler.renders.sizes  # and flow/HiFT calls
    for key, audio in zip("abd", (a, b, d)):
        assert len(audio) == len(alone[key]), key
        assert_close_to_peak(torch.from_numpy(audio), torch.from_numpy(alone[key]), SPEECH, key)
    assert c.size and all_slots_free(synth)


def test_a_reset_never_stalls_another_session(synth, fixed_length, sentences_mode, monkeypatch):
    """The voice state is derived beside the scheduler: made to take 3 s here, another session's
    whole reply is rendered meanwhile."""
    original = synth.voice_prompts.derive

    def slow(name):
        time.sleep(3.0)
        return original(name)

    monkeypatch.setattr(synth.voice_prompts, "derive", slow)

    async def run():
        resetting, speaking = synth.open("anna"), synth.open("tiny_zero_shot_spk")
        reset = asyncio.ensure_future(resetting.reset())
        await asyncio.sleep(0.05)
        audio = [c.audio async for c in speaking.stream(_deltas("Hello world."))]
        reset_done_during_reply = reset.done()
        report = await reset
        await resetting.close()
        await speaking.close()
        return audio, reset_done_during_reply, report

    audio, reset_done_during_reply, report = asyncio.run(run())
    assert sum(map(len, audio)) == N_TOKENS * SAMPLES_PER_TOKEN and not reset_done_during_reply
    assert report.generation == 1 and report.bytes_freed > 0


def test_admission_refuses_past_capacity_with_a_retry_after(synth, monkeypatch):
    costs = synth.scheduler.costs
    monkeypatch.setattr(costs, "decode", {1: 0.01, 2: 0.02, 4: 1.0})  # 25 steps/s: 2 sessions fit in 0.8
    monkeypatch.setattr(costs, "render_per_audio_s", 0.0)
    monkeypatch.setattr(synth, "_lifetimes", synthesizer_mod.deque(maxlen=4))  # no session has closed yet
    monkeypatch.setattr(synth, "contexts", set())
    assert synth.scheduler.capacity() == 2
    refused = synth.scheduler.refused

    async def run():
        first = synth.open()
        assert synth.admit() is None
        second = synth.open()
        retry = synth.admit()  # a third would make 3 speaking
        await second.close()  # a session's lifetime is now known
        again = synth.admit()
        await first.close()
        return retry, again

    retry, again = asyncio.run(run())
    assert retry == synthesizer_mod.DEFAULT_RETRY_AFTER_S and again is None and len(synth._lifetimes) == 2
    assert synth.scheduler.refused == refused + 1 == synth.info().details["scheduler"]["refused"]
    monkeypatch.setattr(costs, "decode", {1: 10.0})  # nothing is real time: the first session is still let in
    assert synth.scheduler.capacity() == 0 and synth.admit() is None


@pytest.mark.parametrize("setting", [{"stream_mode": "recompute"}, {"batching": False}])
def test_test_switches_are_not_user_settings(setting):
    """The official algorithm ("recompute") and unbatched steps are the benches' and tests' (Token2Wav's
    mode, Scheduler's max_batch): a user's configuration cannot choose them."""
    with pytest.raises(ValidationError):
        Cosyvoice2Config(**setting)
