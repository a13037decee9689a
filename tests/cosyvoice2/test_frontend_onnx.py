"""ONNX wrappers and text frontend, run on tiny stand-in models built here (the real files are not shipped)."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from tiny_frontend import make_campplus, make_speech_tokenizer, make_tokenizer, speech_tokens_reference
from voicebot.tts.cosyvoice2 import features
from voicebot.tts.cosyvoice2.frontend import (
    MAX_PROMPT_SECONDS,
    SPECIAL_TOKENS,
    SpeakerEncoder,
    SpeechTokenizer,
    TextFrontend,
    load_text_tokenizer,
    load_wav,
    number_to_words,
)


def _tone(seconds: float, sr: int = 16000) -> torch.Tensor:
    t = torch.arange(int(seconds * sr)) / sr
    return (0.3 * torch.sin(2 * torch.pi * 220 * t) * (1 + 0.5 * torch.sin(2 * torch.pi * 3 * t)))[None]


def test_speaker_encoder_runs_campplus_graph(tmp_path):
    encoder = SpeakerEncoder(make_campplus(tmp_path / "campplus.onnx", seed=3))
    wav = _tone(1.0)
    weight = np.random.default_rng(3).standard_normal((80, 192)).astype(np.float32)
    expected = (features.campplus_input(wav).numpy() @ weight).mean(axis=0)
    emb = encoder(wav)
    assert emb.shape == (1, 192) and emb.dtype == torch.float32
    np.testing.assert_allclose(emb[0].numpy(), expected, rtol=1e-4, atol=1e-4)


def test_speech_tokenizer_gives_one_token_per_four_frames(tmp_path):
    tokenizer = SpeechTokenizer(make_speech_tokenizer(tmp_path / "speech_tokenizer_v2.onnx"))
    wav = _tone(1.2)
    tokens = tokenizer(wav)
    assert tokens.shape == (1, 30) and tokens.dtype == torch.int32  # 120 log-mel frames
    expected = speech_tokens_reference(features.whisper_log_mel(wav).numpy())
    assert tokens.numpy().tolist() == expected.tolist()


def test_speech_tokenizer_refuses_prompts_over_30_s(tmp_path):
    tokenizer = SpeechTokenizer(make_speech_tokenizer(tmp_path / "speech_tokenizer_v2.onnx"))
    with pytest.raises(ValueError, match="30 s"):
        tokenizer(torch.zeros(1, MAX_PROMPT_SECONDS * 16000 + 1))


def test_load_wav_averages_channels_and_resamples(tmp_path):
    stereo = np.stack([_tone(0.5, 24000)[0].numpy(), np.zeros(12000, np.float32)], axis=1)
    sf.write(tmp_path / "a.wav", stereo, 24000, subtype="FLOAT")
    wav = load_wav(tmp_path / "a.wav", 16000)
    expected = features.resample(torch.from_numpy(stereo.mean(axis=1))[None], 24000, 16000)
    assert wav.shape == (1, 8000)
    torch.testing.assert_close(wav, expected)


@pytest.fixture(scope="module")
def text_frontend(tmp_path_factory) -> TextFrontend:
    return TextFrontend(load_text_tokenizer(make_tokenizer(tmp_path_factory.mktemp("qwen"), vocab_size=400)))


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_text_tokenizer(tmp_path)


def test_specials_follow_the_base_vocabulary_without_bos_or_eos(text_frontend):
    tok = text_frontend.tokenizer
    base = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS[2:])
    assert ids == list(range(base + 1, base + 1 + len(SPECIAL_TOKENS) - 2))
    assert text_frontend.encode("[breath]") == [ids[1]]
    plain = text_frontend.encode("Hello world")
    assert tok.convert_tokens_to_ids("<|endoftext|>") not in plain and plain
    # Language tags are not special in CosyVoice 2: they split into plain BPE pieces.
    assert len(text_frontend.encode("<|en|>")) > 1


def test_normalize_english_spells_digits():
    assert number_to_words("0") == "zero"
    assert number_to_words("21") == "twenty-one"
    assert number_to_words("1234") == "one thousand, two hundred and thirty-four"
    assert TextFrontend(None).normalize("  I have 3 cats.\n") == "I have three cats."
    assert TextFrontend(None).normalize("<|en|>3 cats") == "<|en|>3 cats"


def test_normalize_chinese_cleanup_rules():
    # Spaces go first (except between ASCII), so " - " only becomes a comma between ASCII words.
    out = TextFrontend(None).normalize("你好 世界 hello world - ok（测试）5m² 好的，")
    assert out == "你好世界hello world，ok测试5m平方好的。"


def test_split_merges_short_sentences_and_drops_punctuation(text_frontend):
    assert text_frontend.split("Hi. How are you? Fine!") == ["Hi. How are you? Fine!"]
    assert text_frontend.split("这是第一句。这是第二句") == ["这是第一句。这是第二句。"]
    assert text_frontend.split('He said "stop." Then left') == ['He said "stop." Then left.']
    assert text_frontend.split("...") == []


def test_split_cuts_long_text_at_sentence_ends(text_frontend):
    sentence = "This is a tiny test of the tokenizer, one two three. "
    utts = text_frontend.split(sentence * 12)
    assert len(utts) > 1 and "".join(utts) == (sentence * 12).strip()
    assert all(u.endswith(".") for u in utts)
    assert all(len(text_frontend.encode(u)) <= TextFrontend.token_max_n + len(text_frontend.encode(sentence))
               for u in utts)
