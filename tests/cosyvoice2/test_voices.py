"""Voices: prompt extraction, alignment, the memory and disk caches, spk2info entries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from tiny_frontend import make_model_dir
from voicebot.tts.cosyvoice2 import features
from voicebot.tts.cosyvoice2.frontend import Frontend
from voicebot.tts.cosyvoice2.voices import VoiceLibrary, align_prompt


@pytest.fixture(scope="module")
def frontend(tmp_path_factory, cv2_dir) -> Frontend:
    return Frontend.from_model_dir(make_model_dir(tmp_path_factory.mktemp("model"), cv2_dir))


def _write_voice(directory: Path, name: str, seconds: float, transcript: str | None, freq: float = 180.0) -> Path:
    t = np.arange(int(seconds * 24000)) / 24000
    wav = (0.3 * np.sin(2 * np.pi * freq * t) * (1 + 0.3 * np.sin(2 * np.pi * 2 * t))).astype(np.float32)
    sf.write(directory / f"{name}.wav", wav, 24000, subtype="FLOAT")
    if transcript is not None:
        (directory / f"{name}.txt").write_text(transcript)
    return directory / f"{name}.wav"


def test_alignment_rule_keeps_two_frames_per_token():
    tokens, feat = torch.arange(30)[None], torch.zeros(1, 57, 80)
    t, f = align_prompt(tokens, feat)
    assert t.shape == (1, 28) and f.shape == (1, 56, 80)
    t, f = align_prompt(tokens[:, :20], feat)
    assert t.shape == (1, 20) and f.shape == (1, 40, 80)


def test_zero_shot_voice_from_wav_and_transcript(tmp_path, frontend):
    wav = _write_voice(tmp_path, "anna", 1.23, "Hello world.")
    voice = VoiceLibrary(frontend).add_wav("anna", wav, "Hello world.")
    wav16k = features.resample(torch.from_numpy(sf.read(wav, dtype="float32")[0])[None], 24000, 16000)
    n = voice.lm_prompt_speech.shape[1]
    assert voice.prompt_feat.shape == (1, 2 * n, 80) and n == min(1.23 * 24000 // 480 // 2, 1.23 * 16000 // 160 // 4)
    torch.testing.assert_close(voice.lm_prompt_speech, frontend.speech_tokenizer(wav16k)[:, :n])
    torch.testing.assert_close(voice.flow_prompt_speech, voice.lm_prompt_speech)
    torch.testing.assert_close(voice.embedding, frontend.speaker(wav16k))
    assert voice.prompt_text.tolist() == [frontend.text.encode("Hello world.")]
    assert voice.info().language == "en" and "zero-shot" in voice.info().description


def test_voice_without_transcript_is_cross_lingual(tmp_path, frontend):
    voice = VoiceLibrary(frontend).add_wav("x", _write_voice(tmp_path, "x", 1.0, None), "")
    assert voice.prompt_text.numel() == voice.lm_prompt_speech.numel() == 0
    assert voice.flow_prompt_speech.shape[1] == 25 and voice.prompt_feat.shape[1] == 50


def test_disk_cache_is_reused_and_keyed_by_content(tmp_path, frontend, monkeypatch):
    voices_dir, cache = tmp_path / "voices", tmp_path / "cache"
    voices_dir.mkdir()
    _write_voice(voices_dir, "anna", 1.0, "Hello world.")
    _write_voice(voices_dir, "bob", 0.8, "one two three", freq=120.0)
    first = VoiceLibrary(frontend, cache)
    assert first.load_dir(voices_dir) == ["anna", "bob"]
    assert len(list(cache.glob("*.safetensors"))) == 2

    # A second library (a restart) reads the cache: the networks are never called.
    monkeypatch.setattr(frontend, "speaker", None)
    again = VoiceLibrary(frontend, cache)
    again.load_dir(voices_dir)
    for name in ("anna", "bob"):
        for key, value in first[name]._tensors().items():
            torch.testing.assert_close(getattr(again[name], key), value)
    assert [v.name for v in again.list()] == ["anna", "bob"]

    # A new transcript is a new key: with the networks gone, recomputing must fail.
    (voices_dir / "anna.txt").write_text("Hello there.")
    with pytest.raises(RuntimeError, match="campplus"):
        VoiceLibrary(frontend, cache).load_dir(voices_dir)


def test_derive_rebuilds_from_source_and_put_swaps_it_in(tmp_path, frontend, cv2_dir):
    library = VoiceLibrary(frontend, tmp_path / "cache")
    old = library.add_wav("anna", _write_voice(tmp_path, "anna", 1.0, "Hi."), "Hi.")
    library.load_spk2info(cv2_dir / "spk2info.pt")
    for name in ("anna", "tiny_zero_shot_spk"):
        before = library[name]
        after = library.derive(name)
        assert library[name] is before  # derived, not yet in use
        library.put(after)
        assert library[name] is after and after.prompt_feat.data_ptr() != before.prompt_feat.data_ptr()
        torch.testing.assert_close(after.prompt_feat, before.prompt_feat)
    assert library["anna"].embedding.data_ptr() != old.embedding.data_ptr()


@pytest.mark.golden
def test_spk2info_entries(frontend, cv2_dir):
    entries = torch.load(cv2_dir / "spk2info.pt", weights_only=True)
    library = VoiceLibrary(frontend)
    assert library.load_spk2info(cv2_dir / "spk2info.pt") == list(entries)
    for spk_id, entry in entries.items():
        voice = library[spk_id]
        if "embedding" in entry:  # SFT: no prompt at all
            torch.testing.assert_close(voice.embedding, entry["embedding"])
            assert voice.prompt_text.numel() == voice.flow_prompt_speech.numel() == voice.prompt_feat.numel() == 0
            assert "sft" in voice.info().description
        else:
            torch.testing.assert_close(voice.prompt_text, entry["prompt_text"])
            torch.testing.assert_close(voice.lm_prompt_speech, entry["llm_prompt_speech_token"])
            torch.testing.assert_close(voice.flow_prompt_speech, entry["flow_prompt_speech_token"])
            torch.testing.assert_close(voice.prompt_feat, entry["prompt_speech_feat"])
            torch.testing.assert_close(voice.embedding, entry["flow_embedding"])
    assert library.nbytes() > 0
