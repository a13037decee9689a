"""The sentence segmenter: Chinese, English and mixed text, decimals, ellipses, quotes, long sentences."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from voicebot.tts.segmenter import SentenceSegmenter


def split(deltas: list[str] | str, **kwargs) -> list[str]:
    segmenter = SentenceSegmenter(**kwargs)
    out = [s for d in ([deltas] if isinstance(deltas, str) else deltas) for s in segmenter.push(d)]
    rest = segmenter.flush()
    return out + ([rest] if rest else [])


def by_char(text: str, **kwargs) -> list[str]:
    return split(list(text), **kwargs)


def test_english_sentences():
    assert by_char("Hello there, friend. How are you today? I am fine!") == [
        "Hello there, friend.", "How are you today?", "I am fine!"]


def test_chinese_sentences():
    assert by_char("今天天气很好。我们去公园吧！你觉得怎么样？") == ["今天天气很好。", "我们去公园吧！", "你觉得怎么样？"]


def test_mixed_chinese_and_english():
    assert by_char("我喜欢Python编程。It is fun to use. 你呢？我也是") == ["我喜欢Python编程。", "It is fun to use.", "你呢？我也是"]


def test_decimal_points_do_not_end_a_sentence():
    assert by_char("Pi is about 3.14159 and e is 2.718. Nice numbers.") == ["Pi is about 3.14159 and e is 2.718.", "Nice numbers."]
    assert by_char("价格是12.5元。很便宜。") == ["价格是12.5元。", "很便宜。"]
    assert split(["It costs 3.", "5 dollars. OK then."]) == ["It costs 3.5 dollars.", "OK then."]


def test_a_period_inside_a_word_or_after_an_abbreviation_is_not_an_end():
    assert by_char("See example.com for more. Mr. Smith agrees, e.g. on this. Yes indeed.") == [
        "See example.com for more.", "Mr. Smith agrees, e.g. on this.", "Yes indeed."]


def test_ellipses_stay_with_their_sentence():
    assert by_char("Well... I am not sure. Hmm…… 我想想……好吧。") == ["Well...", "I am not sure.", "Hmm…… 我想想……", "好吧。"]


def test_closing_quotes_stay_with_their_sentence():
    assert by_char('He said "Go home now." Then he left.') == ['He said "Go home now."', "Then he left."]
    assert by_char("他说：“你好啊朋友。”然后走了。") == ["他说：“你好啊朋友。”", "然后走了。"]
    assert by_char("Really?!' she asked loudly. Yes.") == ["Really?!'", "she asked loudly.", "Yes."]


def test_short_sentences_merge_until_min_chars():
    assert by_char("Hi! Ok. Let us begin now.") == ["Hi! Ok.", "Let us begin now."]
    assert by_char("好。对。我们开始吧。") == ["好。对。我们开始吧。"]


def test_a_sentence_waits_until_the_next_delta_shows_its_end():
    segmenter = SentenceSegmenter()
    assert segmenter.push("Hello world.") == []  # "..." or a closing quote may follow
    assert segmenter.push(" Next") == ["Hello world."]
    assert segmenter.flush() == "Next"


def test_a_long_sentence_is_cut_at_a_clause_mark_then_a_space():
    text = "This sentence goes on, and on and on and on, without ever stopping to take a breath at all"
    out = by_char(text, max_chars=50)
    assert out[0] == "This sentence goes on, and on and on and on,"
    assert all(len(s) <= 50 for s in out) and " ".join(out) == text
    assert by_char("一" * 25, max_chars=10) == ["一" * 10, "一" * 10, "一" * 5]


@given(st.text(alphabet="ab .,!?3。，…\"”", max_size=200), st.data())
def test_nothing_is_lost_and_the_buffer_stays_bounded(text, data):
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    segmenter = SentenceSegmenter(max_chars=40)
    out = []
    for delta in deltas:
        out += segmenter.push(delta)
        assert len(segmenter._buffer) <= 40 + len(delta)
    rest = segmenter.flush()
    out += [rest] if rest else []
    assert "".join(out).replace(" ", "") == text.replace(" ", "").strip()
