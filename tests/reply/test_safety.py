"""Blocklist and max length on streamed reply text, and the fallback line when a responder fails."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from voicebot.reply.base import ResponderError
from voicebot.reply.safety import SpeechFilter
from voicebot.reply.spoken import spoken


def streamed(rules: SpeechFilter, deltas: list[str]) -> str:
    scrubber = rules.scrubber()
    return "".join(scrubber.push(d) for d in deltas) + scrubber.finish()


def test_blocked_words_are_replaced_case_insensitively_at_word_boundaries():
    rules = SpeechFilter(["darn", "heck"], replacement="beep")
    assert streamed(rules, ["Well DARN it, what the heck."]) == "Well beep it, what the beep."
    assert streamed(rules, ["darned hecks"]) == "darned hecks"  # longer words are not the blocked word


def test_a_phrase_split_over_deltas_is_still_found():
    rules = SpeechFilter(["bad word"])
    assert streamed(rules, ["that is a b", "ad", " wo", "rd indeed"]) == "that is a  indeed"


def test_a_word_that_may_continue_in_the_next_delta_waits_for_it():
    rules = SpeechFilter(["ass"], replacement="*")
    scrubber = rules.scrubber()
    assert scrubber.push("we ass") == "we "  # "ass" may become "assess"
    assert scrubber.push("ess it") == "assess"
    assert scrubber.finish() == " it"
    assert streamed(rules, ["the class ", "ass"]) == "the class *"


def test_chinese_phrases_match_inside_text():
    rules = SpeechFilter(["笨蛋"], replacement="")
    assert streamed(rules, ["你这个笨", "蛋，真是"]) == "你这个，真是"


def test_an_empty_blocklist_holds_nothing_back():
    scrubber = SpeechFilter([]).scrubber()
    assert scrubber.push("Hello th") == "Hello th"


@given(st.lists(st.sampled_from(["darn", "Darn", "dar", "n", " ", "it", "笨蛋", "笨", "蛋", ".", "a", "darnit"]), max_size=30),
       st.data())
def test_streaming_gives_the_same_text_however_the_deltas_are_cut(pieces, data):
    rules = SpeechFilter(["darn", "笨蛋", "it is"], replacement="#")
    text = "".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(rules, deltas) == streamed(rules, [text])


def test_max_length_cuts_at_a_word_boundary_and_stops():
    rules = SpeechFilter([], max_chars=20)
    scrubber = rules.scrubber()
    out = scrubber.push("The quick brown fox ") + scrubber.push("jumps over the lazy dog.")
    assert out == "The quick brown fox "
    assert scrubber.full and scrubber.push("more") == ""
    assert scrubber.cut == "jumps over the lazy dog.more"  # what the limit kept from being spoken
    assert streamed(SpeechFilter([], max_chars=12), ["The quick brown fox"]) == "The quick "
    assert streamed(SpeechFilter([], max_chars=4), ["你好世界和平"]) == "你好世界"


async def _deltas(items, fail: ResponderError | None = None, closed: list | None = None):
    try:
        for item in items:
            yield item
        if fail:
            raise fail
    finally:
        if closed is not None:
            closed.append(True)


def _spoken(items, fail=None, rules=None, closed=None):
    failures = []

    async def on_failure(exc):
        failures.append(exc.kind)

    async def main():
        source = _deltas(items, fail, closed)
        return [t async for t in spoken(source, rules or SpeechFilter([]), "Sorry?", on_failure)]

    return asyncio.run(main()), failures


def test_a_failure_before_any_text_speaks_the_fallback_line():
    assert _spoken([], ResponderError("status", "503")) == (["Sorry?"], ["status"])


def test_a_failure_after_some_text_keeps_it_and_adds_nothing():
    assert _spoken(["Once", " upon"], ResponderError("dropped", "gone")) == (["Once", " upon"], ["dropped"])


def test_an_unexpected_exception_is_an_internal_failure():
    async def broken():
        raise KeyError("choices")
        yield ""

    failures = []

    async def on_failure(exc):
        failures.append(exc.kind)

    async def main():
        return [t async for t in spoken(broken(), SpeechFilter([]), "Sorry?", on_failure)]

    assert asyncio.run(main()) == ["Sorry?"] and failures == ["internal"]


def test_reaching_max_length_closes_the_responder():
    closed = []
    texts, failures = _spoken(["one two ", "three four ", "five six"], rules=SpeechFilter([], max_chars=10), closed=closed)
    assert "".join(texts) == "one two "
    assert closed == [True] and failures == []
