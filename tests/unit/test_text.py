"""The one CJK test and the one text joiner (voicebot/text.py)."""

from __future__ import annotations

import unicodedata

import pytest

from voicebot import text
from voicebot.text import is_cjk, is_hangul, joined


@pytest.mark.parametrize("char", [
    "中", "一", "\u9fff",  # CJK Unified Ideographs, both ends
    "㐀", "\u4dbf",  # Extension A
    "𠀀", "\U0002a6d6", "\U00030000",  # Extension B, its last, Extension G
    "豈", "\U0002f800",  # compatibility ideographs and their supplement
    "あ", "ア", "ｱ", "ㇰ",  # hiragana, katakana, halfwidth katakana, phonetic extensions
    "ㄅ",  # bopomofo
    "한", "ᄀ", "ㄱ", "ﾡ",  # hangul syllable, jamo, compatibility jamo, halfwidth
    "。", "、", "「", "\u3000", "，", "！", "？", "Ａ", "︐",  # CJK and fullwidth punctuation, fullwidth Latin
])
def test_cjk_characters(char):
    assert is_cjk(char)


@pytest.mark.parametrize("char", ["a", "Z", "0", ".", ",", " ", "é", "ß", "я", "ا", "क", "😀", "\u2e7f", "\ua000", "\U0002fa20"])
def test_other_characters_are_not_cjk(char):
    assert not is_cjk(char)


def test_hangul_is_cjk_and_nothing_else_cjk_is_hangul():
    assert all(is_hangul(c) for c in "한국어ᄀㄱ")
    assert not any(is_hangul(c) for c in "中あア。，a")


def test_the_ranges_are_sorted_and_do_not_overlap():
    for ranges in (text._CJK, text._HANGUL):
        assert all(a_last < b_first for (_, a_last), (b_first, _) in zip(ranges, ranges[1:]))
        assert all(first <= last for first, last in ranges)


def test_every_named_ideograph_and_kana_is_cjk():
    """Against Unicode's own names: every CJK UNIFIED/COMPATIBILITY IDEOGRAPH, HIRAGANA, KATAKANA,
    HANGUL SYLLABLE and FULLWIDTH character in the BMP and the ideographic planes."""
    prefixes = ("CJK UNIFIED IDEOGRAPH", "CJK COMPATIBILITY IDEOGRAPH", "HIRAGANA", "KATAKANA", "HANGUL", "FULLWIDTH",
                "IDEOGRAPHIC", "BOPOMOFO", "HALFWIDTH KATAKANA")
    named = [chr(c) for c in [*range(0x10000), *range(0x20000, 0x32400)]
             if unicodedata.name(chr(c), "").startswith(prefixes)]
    assert len(named) > 90000  # the walk saw the ideographs
    assert [c for c in named if not is_cjk(c)] == []


@pytest.mark.parametrize("pieces, expected", [
    (["hello", "world"], "hello world"),
    (["你好", "世界"], "你好世界"),
    (["你好。", "我很好。"], "你好。我很好。"),
    (["Hello.", "How are you?"], "Hello. How are you?"),
    (["你好。", "OK"], "你好。OK"),
    (["hello", "你好"], "hello你好"),  # as FunASR's recognizers write mixed text
    (["こんにちは", "世界"], "こんにちは世界"),
    (["안녕하세요", "반갑습니다"], "안녕하세요 반갑습니다"),  # Korean puts spaces between words
    (["  hello ", "", "   ", "world  "], "hello world"),  # stripped; the empty ones left out
    ([], ""),
])
def test_joined(pieces, expected):
    assert joined(pieces) == expected
