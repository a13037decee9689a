"""Text across scripts, decided once: which characters are CJK, and how pieces of text join.

`is_cjk` is true for a character of Chinese, Japanese or Korean writing, by Unicode block:

- Han ideographs: CJK Unified Ideographs and Extension A, Extensions B to I (the supplementary
  ideographic planes), the compatibility ideographs and their supplement, the radicals;
- kana: hiragana, katakana and its phonetic extensions (halfwidth katakana: with the forms below);
- bopomofo;
- hangul: syllables, jamo, compatibility and extended jamo;
- CJK typesetting: the CJK symbols and punctuation (、。「」 and the ideographic space), the
  vertical and compatibility forms, the halfwidth and fullwidth forms (，！？ and fullwidth Latin).

Not CJK: Latin, digits, ASCII punctuation, emoji and every other script.

`joined` puts pieces (transcripts of one turn, sentences of one reply) together as one text: a
space between two pieces, none where the seam touches a character of a language written without
spaces between words (CJK other than hangul: Korean puts spaces between words, Chinese and
Japanese do not). So "hello" + "world" is "hello world", "你好" + "世界" is "你好世界", "你好。" +
"OK" is "你好。OK", and "hello" + "你好" is "hello你好", as FunASR's recognizers write mixed text
(voicebot/asr/sanm/stream.py `tokens_to_text`): a turn heard in two pieces reads as it would in one.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

# (first, last) code points, sorted, not overlapping.
_HANGUL = (
    (0x1100, 0x11FF),  # Hangul Jamo
    (0x3130, 0x318F),  # Hangul Compatibility Jamo
    (0xA960, 0xA97F),  # Hangul Jamo Extended-A
    (0xAC00, 0xD7AF),  # Hangul Syllables
    (0xD7B0, 0xD7FF),  # Hangul Jamo Extended-B
    (0xFFA0, 0xFFDC),  # halfwidth hangul (inside Halfwidth and Fullwidth Forms)
)
_CJK = tuple(sorted((
    (0x2E80, 0x2FDF),  # CJK Radicals Supplement, Kangxi Radicals
    (0x2FF0, 0x2FFF),  # Ideographic Description Characters
    (0x3000, 0x303F),  # CJK Symbols and Punctuation
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x3100, 0x312F),  # Bopomofo
    (0x3190, 0x31FF),  # Kanbun, Bopomofo Extended, CJK Strokes, Katakana Phonetic Extensions
    (0x3200, 0x33FF),  # Enclosed CJK Letters and Months, CJK Compatibility
    (0x3400, 0x4DBF),  # CJK Unified Ideographs Extension A
    (0x4E00, 0x9FFF),  # CJK Unified Ideographs
    (0xF900, 0xFAFF),  # CJK Compatibility Ideographs
    (0xFE10, 0xFE1F),  # Vertical Forms (vertical punctuation)
    (0xFE30, 0xFE4F),  # CJK Compatibility Forms
    (0xFF00, 0xFF9F),  # Halfwidth and Fullwidth Forms: fullwidth ASCII, halfwidth CJK punctuation and katakana
    (0xFFE0, 0xFFEF),  # Halfwidth and Fullwidth Forms: fullwidth signs
    (0x20000, 0x2FA1F),  # Extensions B to F, Compatibility Ideographs Supplement (the SIP)
    (0x30000, 0x323AF),  # Extensions G and H (the TIP)
    *_HANGUL,
)))
_CJK_FIRSTS = [first for first, _ in _CJK]
_HANGUL_FIRSTS = [first for first, _ in _HANGUL]


def _within(char: str, ranges: tuple[tuple[int, int], ...], firsts: list[int]) -> bool:
    code = ord(char)
    i = bisect_right(firsts, code) - 1
    return i >= 0 and code <= ranges[i][1]


def is_cjk(char: str) -> bool:
    """Whether `char` (one character) is of Chinese, Japanese or Korean writing (see the module doc)."""
    return _within(char, _CJK, _CJK_FIRSTS)


def is_hangul(char: str) -> bool:
    """Whether `char` (one character) is Korean hangul: CJK, but written with spaces between words."""
    return _within(char, _HANGUL, _HANGUL_FIRSTS)


def _unspaced(char: str) -> bool:
    return is_cjk(char) and not is_hangul(char)


def joined(pieces: Iterable[str]) -> str:
    """The pieces, each stripped, the empty ones left out, as one text (see the module doc)."""
    out = ""
    for piece in (p.strip() for p in pieces):
        if not piece:
            continue
        if out and not (_unspaced(out[-1]) or _unspaced(piece[0])):
            out += " "
        out += piece
    return out
