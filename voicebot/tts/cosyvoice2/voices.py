"""Voices: the prompt state of a reference recording, computed once and shared by every session.

A voice comes from a voices directory (`<name>.wav` plus its transcript `<name>.txt`; without a
transcript it is a cross-lingual voice: the LM gets no prompt, the flow still does) or from an entry
of the model's spk2info.pt. Prompt speech tokens, speaker embedding and prompt mel are kept in memory
and in `cache_dir/<key>.safetensors`, where the key hashes the wav bytes, the transcript and the
frontend files, so a changed recording, transcript or model never reuses stale features.

What the LM can reuse is limited by its input layout (spec §6.1): [sos | prompt text | reply text |
task_id | prompt speech]. Only [sos | prompt text] precedes the reply, so only that prefix (and its
KV entries) is the same for every utterance; the prompt speech embeddings are reused as tensors.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from voicebot.tts.base import VoiceInfo
from voicebot.tts.cosyvoice2 import features
from voicebot.tts.cosyvoice2.frontend import Frontend, language, load_wav

log = logging.getLogger(__name__)

TOKEN_MEL_RATIO = 2  # mel frames per speech token


@dataclass(frozen=True)
class Voice:
    name: str
    source: str  # the wav path, or "spk2info:<id>"
    transcript: str
    prompt_text: torch.Tensor  # (1, Lt) int32 text ids; empty for SFT and cross-lingual voices
    lm_prompt_speech: torch.Tensor  # (1, P) int32; empty when the LM gets no speech prompt
    flow_prompt_speech: torch.Tensor  # (1, P') int32
    prompt_feat: torch.Tensor  # (1, 2P', 80) float32, 24 kHz log-mel
    embedding: torch.Tensor  # (1, 192) float32 campplus

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def info(self) -> VoiceInfo:
        kind = "zero-shot" if self.lm_prompt_speech.numel() else "cross-lingual" if self.flow_prompt_speech.numel() else "sft"
        lang = language(self.transcript) if self.transcript else None
        return VoiceInfo(self.name, lang, f"{kind} voice from {self.source}")

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}


def align_prompt(tokens: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep exactly TOKEN_MEL_RATIO mel frames per prompt token (frontend_meta.json "zero_shot_alignment")."""
    n = min(feat.shape[1] // TOKEN_MEL_RATIO, tokens.shape[1])
    return tokens[:, :n], feat[:, : TOKEN_MEL_RATIO * n]


def _empty_ids() -> torch.Tensor:
    return torch.zeros(1, 0, dtype=torch.int32)


class VoiceLibrary:
    def __init__(self, frontend: Frontend, cache_dir: str | Path | None = None) -> None:
        self.frontend = frontend
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._voices: dict[str, Voice] = {}
        self._spk2info: dict[str, Path] = {}  # voice name -> the file it came from

    def __contains__(self, name: str) -> bool:
        return name in self._voices

    def __getitem__(self, name: str) -> Voice:
        return self._voices[name]

    def names(self) -> list[str]:
        return list(self._voices)

    def list(self) -> list[VoiceInfo]:
        return [v.info() for v in self._voices.values()]

    def nbytes(self) -> int:
        return sum(v.nbytes() for v in self._voices.values())

    # --- sources

    def load_dir(self, voices_dir: str | Path) -> list[str]:
        """Every `<name>.wav` in the directory, with `<name>.txt` as its transcript when present."""
        added = []
        for wav in sorted(Path(voices_dir).glob("*.wav")):
            txt = wav.with_suffix(".txt")
            transcript = txt.read_text(encoding="utf-8").strip() if txt.is_file() else ""
            added.append(self.add_wav(wav.stem, wav, transcript).name)
        return added

    def load_spk2info(self, path: str | Path) -> list[str]:
        entries = torch.load(str(path), map_location="cpu", weights_only=True)
        for spk_id, entry in entries.items():
            self._put(self._from_spk2info(spk_id, entry))
            self._spk2info[spk_id] = Path(path)
        return list(entries)

    def add_wav(self, name: str, wav_path: str | Path, transcript: str = "") -> Voice:
        voice = self._cached_or_computed(name, Path(wav_path), transcript)
        self._put(voice)
        self._spk2info.pop(name, None)
        return voice

    def derive(self, name: str) -> Voice:
        """A voice's prompt state derived again from its source, not yet in use (`put` swaps it in)."""
        old = self._voices[name]
        if name in self._spk2info:
            entry = torch.load(str(self._spk2info[name]), map_location="cpu", weights_only=True)[name]
            return self._from_spk2info(name, entry)
        return self._cached_or_computed(name, Path(old.source), old.transcript)

    def put(self, voice: Voice) -> None:
        """Use `voice` from now on, in place of any voice of its name."""
        self._put(voice)

    # --- computing and caching

    def _put(self, voice: Voice) -> None:
        # Replacing an entry is one atomic dict store: sessions reading voices on the event loop
        # never see a half-built one while a reset refreshes it on the worker.
        self._voices[voice.name] = voice

    def cache_key(self, wav_path: Path, transcript: str) -> str:
        digest = hashlib.sha256(self.frontend.fingerprint.encode())
        digest.update(hashlib.sha256(wav_path.read_bytes()).digest())
        digest.update(transcript.encode())
        return digest.hexdigest()[:32]

    def _cached_or_computed(self, name: str, wav_path: Path, transcript: str) -> Voice:
        path = self.cache_dir / f"{self.cache_key(wav_path, transcript)}.safetensors" if self.cache_dir else None
        if path is not None and path.is_file():
            try:
                tensors = load_file(path)
                return Voice(name=name, source=str(wav_path), transcript=transcript, **tensors)
            except Exception as exc:  # a truncated or foreign file: recompute and overwrite it
                log.warning("voice cache %s unreadable (%s); recomputing", path, exc)
        voice = self._compute(name, wav_path, transcript)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            # Packed, unshared copies: safetensors refuses views, and LM and flow may hold one token tensor.
            packed = {k: v.clone(memory_format=torch.contiguous_format) for k, v in voice._tensors().items()}
            save_file(packed, tmp)
            tmp.replace(path)  # atomic: a concurrent reader never sees half a file
        return voice

    def _compute(self, name: str, wav_path: Path, transcript: str) -> Voice:
        fe = self.frontend
        if fe.speaker is None or fe.speech_tokenizer is None:
            raise RuntimeError(f"voice {name!r}: the model directory lacks campplus.onnx or speech_tokenizer_v2.onnx")
        wav16k = load_wav(wav_path, features.TOKENIZER_SAMPLE_RATE)
        tokens, feat = align_prompt(
            fe.speech_tokenizer(wav16k), features.prompt_mel(load_wav(wav_path, features.PROMPT_SAMPLE_RATE))
        )
        text_ids = torch.tensor([fe.text.encode(fe.text.normalize(transcript))], dtype=torch.int32) if transcript else _empty_ids()
        return Voice(
            name=name,
            source=str(wav_path),
            transcript=transcript,
            prompt_text=text_ids.reshape(1, -1),
            lm_prompt_speech=tokens if transcript else _empty_ids(),
            flow_prompt_speech=tokens,
            prompt_feat=feat,
            embedding=fe.speaker(wav16k),
        )

    @staticmethod
    def _from_spk2info(spk_id: str, entry: dict[str, torch.Tensor]) -> Voice:
        if "embedding" in entry:  # an SFT speaker: embedding only, no prompt for LM or flow
            return Voice(spk_id, f"spk2info:{spk_id}", "", _empty_ids(), _empty_ids(), _empty_ids(),
                         torch.zeros(1, 0, 80), entry["embedding"].float().reshape(1, -1))
        return Voice(
            name=spk_id,
            source=f"spk2info:{spk_id}",
            transcript="",
            prompt_text=entry["prompt_text"].int().reshape(1, -1),
            lm_prompt_speech=entry["llm_prompt_speech_token"].int().reshape(1, -1),
            flow_prompt_speech=entry["flow_prompt_speech_token"].int().reshape(1, -1),
            prompt_feat=entry["prompt_speech_feat"].float(),
            embedding=entry["flow_embedding"].float().reshape(1, -1),
        )
