"""The end-of-turn test set: turns with pauses inside them, and complete turns, with their true end.

Made at run time with espeak-ng (tests/audio.py), English and Mandarin, no audio files in the
repository. A paused turn is said in parts joined by real silences of 300-900 ms: "I would like
to, ... order a pizza." Each part but the last ends in a comma, which espeak-ng voices as a
continuing clause (no final fall), as people do when they hold the floor. A turn is over only at
the end of its last part: a reply that starts before then cuts the user off.

    from tests.turn_set import TURNS, render
    item = TURNS[0]; turn = render(item)   # turn.audio (16 kHz float32), turn.end_s, turn.pauses

Used by tests/unit/test_turn.py and bench/latency.py.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.audio import espeak_speech

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_RATE = 16000
PAUSES_MS = (300, 450, 600, 750, 900, 350, 500, 650, 800)  # cycled over the paused turns
VOICES = {"en": "en-us", "zh": "cmn"}

PAUSED_EN = [
    ("I would like to,", "order a pizza."),
    ("first,", "turn on the lights, then play some music."),
    ("can you tell me,", "um,", "what the weather is tomorrow?"),
    ("I need eggs,", "milk,", "and bread."),
    ("so the thing is,", "I forgot my password."),
    ("my favourite game is,", "probably chess."),
    ("let me think,", "I want the blue one."),
    ("we could go to the park,", "or stay at home."),
    ("what I really want is,", "a long holiday."),
    ("um,", "how old are you?"),
    ("the best part of the show was,", "the ending."),
    ("tell me about,", "the history of Rome."),
    ("I was wondering if,", "you could help me."),
    ("first we go left,", "then right,", "then straight on."),
    ("the answer is,", "forty two."),
    ("play a song by,", "the Beatles."),
    ("yesterday I went to,", "the market."),
    ("could you,", "uh,", "repeat that please?"),
    ("my name is,", "Alex."),
    ("I think that,", "we should start now."),
    ("how about,", "a quick game?"),
    ("the capital of France is,", "Paris, right?"),
    ("remind me to,", "call my mother."),
    ("I like apples,", "bananas,", "and oranges."),
    ("well,", "that depends on the price."),
    ("give me a number between,", "one and ten."),
]
PAUSED_ZH = [
    ("我想要，", "点一个披萨。"),
    ("首先，", "打开灯，然后放点音乐。"),
    ("你能告诉我，", "明天天气怎么样吗？"),
    ("我需要鸡蛋，", "牛奶，", "还有面包。"),
    ("嗯，", "你今年多大了？"),
    ("我觉得，", "我们应该现在开始。"),
    ("我最喜欢的游戏是，", "象棋。"),
    ("我们可以去公园，", "或者待在家里。"),
    ("昨天我去了，", "菜市场。"),
    ("请提醒我，", "给妈妈打电话。"),
    ("这个问题的答案是，", "四十二。"),
    ("那个，", "你叫什么名字？"),
    ("我想问一下，", "这个多少钱？"),
    ("先往左走，", "再往右走，", "然后一直走。"),
]
COMPLETE_EN = [
    "Hello there, how are you?",
    "Please tell me a joke about the weather.",
    "What time does the show start tomorrow?",
    "Stop talking now.",
    "I would like to order a pizza.",
    "Turn on the lights.",
    "What is the weather like tomorrow?",
    "I forgot my password.",
    "My favourite game is chess.",
    "How old are you?",
    "Tell me about the history of Rome.",
    "Can you help me with my homework?",
    "The answer is forty two.",
    "Play a song by the Beatles.",
    "Yesterday I went to the market.",
    "Could you repeat that please?",
    "My name is Alex.",
    "We should start now.",
    "That was a great game.",
    "What is the capital of France?",
    "Remind me to call my mother.",
    "I like apples and bananas.",
    "Thank you very much.",
    "Give me a number between one and ten.",
    "Good night, see you tomorrow.",
    "Why is the sky blue?",
]
COMPLETE_ZH = [
    "你好，最近怎么样？",
    "给我讲一个笑话。",
    "明天的节目几点开始？",
    "我想点一个披萨。",
    "请把灯打开。",
    "明天天气怎么样？",
    "你今年多大了？",
    "我们现在开始吧。",
    "你叫什么名字？",
    "这个多少钱？",
    "谢谢你的帮助。",
    "晚安，明天见。",
    "天空为什么是蓝色的？",
    "请给妈妈打电话。",
]


@dataclass(frozen=True)
class TurnItem:
    name: str
    language: str  # "en" | "zh"
    parts: tuple[str, ...]
    pauses_ms: tuple[int, ...]  # one per gap between parts; () for a complete turn

    @property
    def paused(self) -> bool:
        return bool(self.pauses_ms)

    @property
    def text(self) -> str:
        return " ".join(self.parts)


@dataclass(frozen=True)
class RenderedTurn:
    item: TurnItem
    audio: np.ndarray  # 16 kHz float32, speech only: no lead-in, no trailing silence
    end_s: float  # the true end of the turn (end of the last part's speech)
    pauses: tuple[tuple[float, float], ...]  # (start_s, end_s) of each silence inside the turn


def _items() -> list[TurnItem]:
    items = []
    gaps = iter(PAUSES_MS * 20)
    for language, paused, complete in (("en", PAUSED_EN, COMPLETE_EN), ("zh", PAUSED_ZH, COMPLETE_ZH)):
        for i, parts in enumerate(paused):
            items.append(TurnItem(f"{language}-paused-{i:02d}", language, parts, tuple(next(gaps) for _ in parts[1:])))
        for i, text in enumerate(complete):
            items.append(TurnItem(f"{language}-complete-{i:02d}", language, (text,), ()))
    return items


TURNS: list[TurnItem] = _items()


def _trim(audio: np.ndarray, floor: float = 0.005) -> np.ndarray:
    """Cut espeak's own leading and trailing near-silence, so the joins are the pauses we chose."""
    loud = np.nonzero(np.abs(audio) > floor)[0]
    return audio[loud[0] : loud[-1] + 1] if len(loud) else audio[:0]


@functools.cache
def _synthesis_key() -> str:
    """What the rendered audio depends on besides the text: the synthesis code and the espeak-ng data."""
    import espeakng_loader

    digest = hashlib.sha1()
    for path in (REPO_ROOT / "tests" / "audio.py", REPO_ROOT / "voicebot" / "tts" / "espeak.py", Path(__file__)):
        digest.update(path.read_bytes())
    digest.update(str(os.stat(espeakng_loader.get_library_path()).st_mtime_ns).encode())
    return digest.hexdigest()[:16]


def _part(text: str, voice: str) -> np.ndarray:
    """One part's speech, trimmed; kept on disk between runs (espeak-ng takes minutes for the set on a loaded box)."""
    key = hashlib.sha1(f"{_synthesis_key()} {voice} {SAMPLE_RATE} {text}".encode()).hexdigest()
    path = Path(tempfile.gettempdir()) / "voicebot-turn-set" / f"{key}.npy"
    if path.is_file():
        return np.load(path)
    speech = _trim(espeak_speech(text, voice, SAMPLE_RATE))
    path.parent.mkdir(exist_ok=True)
    np.save(path.with_suffix(f".{os.getpid()}.npy"), speech)
    os.replace(path.with_suffix(f".{os.getpid()}.npy"), path)  # whole or not at all, with two renderers at once
    return speech


@functools.cache
def render(item: TurnItem) -> RenderedTurn:
    pieces, pauses, t = [], [], 0
    for i, part in enumerate(item.parts):
        speech = _part(part, VOICES[item.language])
        pieces.append(speech)
        t += len(speech)
        if i < len(item.pauses_ms):
            gap = np.zeros(SAMPLE_RATE * item.pauses_ms[i] // 1000, np.float32)
            pauses.append((t / SAMPLE_RATE, (t + len(gap)) / SAMPLE_RATE))
            pieces.append(gap)
            t += len(gap)
    return RenderedTurn(item, np.concatenate(pieces), t / SAMPLE_RATE, tuple(pauses))


def render_all(items: list[TurnItem], workers: int = 2) -> list[RenderedTurn]:
    """Render many (espeak-ng runs in a fresh process per part: two at a time keep both cores busy)."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(render, items))
