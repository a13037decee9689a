"""The CosyVoice 2 frontend (spec §3, §5): text → token ids, prompt audio → model inputs.

Audio features are in features.py; this module adds the two ONNX networks shipped with the model
(campplus speaker embedding, speech tokenizer v2), the Qwen text tokenizer and a light text
normaliser with the official sentence splitting.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnxruntime as ort
import soundfile as sf
import torch

from voicebot.text import is_cjk, is_hangul
from voicebot.tts.cosyvoice2 import features

CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
QWEN_DIR = "CosyVoice-BlankEN"
# Bump when feature extraction changes: it is part of every cached voice's key.
FEATURES_VERSION = "1"
MAX_PROMPT_SECONDS = 30  # the speech tokenizer was trained on ≤ 30 s; the official code refuses more

# spec §3: appended after <|endoftext|>/<|im_start|>/<|im_end|>, in this order, so ids stay 151646+.
SPECIAL_TOKENS = [
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
]  # fmt: skip


def load_wav(path: str | Path, sample_rate: int) -> torch.Tensor:
    """A sound file as (1, N) float32 mono at `sample_rate` (channels averaged, torchaudio-exact resampling)."""
    data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    wav = torch.from_numpy(data.mean(axis=1))[None]
    return features.resample(wav, sr, sample_rate)


# --- ONNX networks


def onnx_session(path: str | Path, cuda: bool = False) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # One thread: the server runs many small calls side by side, and torch already uses the cores.
    opts.intra_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), sess_options=opts, providers=providers)


class SpeakerEncoder:
    """campplus.onnx: Kaldi fbank (1, T, 80) → speaker embedding (1, 192)."""

    def __init__(self, path: str | Path) -> None:
        self._session = onnx_session(path)
        self._input = self._session.get_inputs()[0].name

    def __call__(self, wav16k: torch.Tensor) -> torch.Tensor:
        feat = features.campplus_input(wav16k)[None].numpy()
        out = self._session.run(None, {self._input: feat})[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(1, -1))


class SpeechTokenizer:
    """speech_tokenizer_v2.onnx: whisper log-mel (1, 128, T) + length (1,) → tokens (1, T/4), 25 Hz."""

    def __init__(self, path: str | Path, cuda: bool = False) -> None:
        self._session = onnx_session(path, cuda)
        self._inputs = [i.name for i in self._session.get_inputs()]

    def __call__(self, wav16k: torch.Tensor) -> torch.Tensor:
        if wav16k.shape[-1] > MAX_PROMPT_SECONDS * features.TOKENIZER_SAMPLE_RATE:
            raise ValueError(f"prompt audio longer than {MAX_PROMPT_SECONDS} s cannot be tokenized")
        mel = features.whisper_log_mel(wav16k).numpy()
        length = np.array([mel.shape[2]], dtype=np.int32)
        out = self._session.run(None, dict(zip(self._inputs, (mel, length))))[0]
        return torch.from_numpy(np.asarray(out).astype(np.int32).reshape(1, -1))


# --- text


def load_text_tokenizer(qwen_dir: str | Path):
    """The Qwen BPE of CosyVoice-BlankEN with the CosyVoice specials added (no BOS/EOS is ever added)."""
    from transformers import AutoTokenizer

    if not any((Path(qwen_dir) / name).is_file() for name in ("tokenizer.json", "vocab.json")):
        raise FileNotFoundError(f"{qwen_dir} holds no tokenizer (tokenizer.json or vocab.json + merges.txt)")
    tokenizer = AutoTokenizer.from_pretrained(str(qwen_dir))
    tokenizer.add_special_tokens(
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "additional_special_tokens": SPECIAL_TOKENS}
    )
    return tokenizer


SENTENCE_END = {"zh": "。？！；：、.?!;", "en": ".?!;:"}
CLOSING_QUOTES = "\"”"


def language(text: str) -> str:
    return "zh" if any(is_cjk(c) and not is_hangul(c) for c in text) else "en"  # Chinese or Japanese writing


class TextFrontend:
    """Normalise, split and tokenize text like the official frontend (spec §5.1), minus its TN engines.

    Neither ttsfrd (closed) nor wetext (FST tables, not a dependency here) is used: Chinese text gets
    the official clean-up rules around the normaliser, English text gets its digits spelled out.
    """

    token_max_n, token_min_n, merge_len = 80, 60, 20

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer([text])["input_ids"][0]

    def normalize(self, text: str) -> str:
        if not text or ("<|" in text and "|>" in text):
            return text
        text = text.strip()
        return _normalize_zh(text) if language(text) == "zh" else _spell_out_numbers(text)

    def split(self, text: str) -> list[str]:
        """Normalised text → utterances of about 60–80 tokens (characters for Chinese), cut at sentence ends."""
        text = self.normalize(text)
        if not text or ("<|" in text and "|>" in text):
            return [text] if text else []
        lang = language(text)
        length: Callable[[str], int] = len if lang == "zh" else (lambda s: len(self.encode(s)))
        return [u for u in _merge(split_at_sentence_marks(text, lang), length, self.token_max_n, self.token_min_n, self.merge_len)
                if not only_punctuation(u)]


def split_at_sentence_marks(text: str, lang: str) -> list[str]:
    """Cut after each sentence mark (keeping a closing quote that follows it); end with a full stop."""
    ends = SENTENCE_END[lang]
    if text[-1] not in ends:
        text += "。" if lang == "zh" else "."
    out, start, i = [], 0, 0
    while i < len(text):
        if text[i] in ends:
            stop = i + 2 if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES else i + 1
            if i > start:
                out.append(text[start:stop])
            start = i = stop
        else:
            i += 1
    return out


def _merge(pieces: Iterable[str], length: Callable[[str], int], max_n: int, min_n: int, merge_len: int) -> list[str]:
    utts, cur = [], ""
    for piece in pieces:
        if length(cur + piece) > max_n and length(cur) > min_n:
            utts.append(cur)
            cur = ""
        cur += piece
    if cur:
        if utts and length(cur) < merge_len:
            utts[-1] += cur
        else:
            utts.append(cur)
    return utts


def only_punctuation(text: str) -> bool:
    return not any(ch.isalnum() for ch in text)


def _normalize_zh(text: str) -> str:
    text = text.replace("\n", "")
    # A space survives only between two ASCII non-space characters (English words inside Chinese).
    text = re.sub(r"(?<![!-~]) | (?![!-~])", "", text)
    text = text.replace("²", "平方").replace("³", "立方").replace(".", "。").replace(" - ", "，")
    text = re.sub(r"[（）【】`]", "", text).replace("——", " ")
    return re.sub(r"[，,、]+$", "。", text)


_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " \
        "sixteen seventeen eighteen nineteen".split()  # fmt: skip
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ["", "thousand", "million", "billion", "trillion"]


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    words = f"{_ONES[hundreds]} hundred" if hundreds else ""
    if rest:
        tens = _ONES[rest] if rest < 20 else _TENS[rest // 10] + (f"-{_ONES[rest % 10]}" if rest % 10 else "")
        words = f"{words} and {tens}" if words else tens
    return words


def number_to_words(digits: str) -> str:
    """Spell a digit string as inflect's number_to_words does ("1234" → "one thousand, two hundred and thirty-four")."""
    n = int(digits)
    if n >= 1000 ** len(_SCALES):
        return " ".join(_ONES[int(d)] for d in digits)
    if n < 1000:
        return _below_thousand(n) if n else "zero"
    groups = []
    for scale in _SCALES:
        n, group = divmod(n, 1000)
        if group:
            groups.append(f"{_below_thousand(group)} {scale}".strip())
        if not n:
            break
    return ", ".join(reversed(groups))


def _spell_out_numbers(text: str) -> str:
    return re.sub(r"\d+", lambda m: number_to_words(m.group()), text)


# --- everything together


@dataclass
class Frontend:
    """The frontend of one model directory. The ONNX networks are optional: without them only
    spk2info voices (whose features were computed elsewhere) can be used."""

    text: TextFrontend
    speaker: SpeakerEncoder | None
    speech_tokenizer: SpeechTokenizer | None
    fingerprint: str  # identifies the files whose outputs a cached voice depends on

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, cuda: bool = False) -> Frontend:
        model_dir = Path(model_dir)
        campplus, tokenizer = model_dir / CAMPPLUS_FILE, model_dir / SPEECH_TOKENIZER_FILE
        qwen = model_dir / QWEN_DIR
        digest = hashlib.sha256(FEATURES_VERSION.encode())
        # Size and mtime, not contents: hashing a 500 MB tokenizer at every start-up is not worth it.
        for path in sorted([campplus, tokenizer, *qwen.glob("*token*"), *qwen.glob("vocab*"), *qwen.glob("merges*")]):
            if path.is_file():
                stat = path.stat()
                digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
        return cls(
            text=TextFrontend(load_text_tokenizer(qwen)),
            speaker=SpeakerEncoder(campplus) if campplus.is_file() else None,
            speech_tokenizer=SpeechTokenizer(tokenizer, cuda) if tokenizer.is_file() else None,
            fingerprint=digest.hexdigest(),
        )
