"""The conversation's turn and token budgets."""

from __future__ import annotations

from voicebot.reply.history import Conversation, estimate_tokens


def exchange(c: Conversation, user: str, bot: str) -> None:
    c.add_user(user)
    c.add_assistant(bot)


def test_token_estimate_counts_cjk_characters_one_each():
    assert estimate_tokens("你好世界") == 4
    assert estimate_tokens("abcdefgh") == 2
    assert estimate_tokens("") == 0


def test_turn_budget_drops_whole_exchanges_oldest_first():
    c = Conversation(max_turns=2)
    for i in range(4):
        exchange(c, f"q{i}", f"a{i}")
    assert [m["content"] for m in c.messages()] == ["q2", "a2", "q3", "a3"]


def test_token_budget_drops_oldest_exchanges_and_never_leaves_an_orphaned_answer():
    c = Conversation(max_turns=100, max_tokens=10)
    exchange(c, "a" * 16, "b" * 16)  # 4 + 4 tokens
    exchange(c, "c" * 8, "d" * 8)  # 2 + 2: 12 in all, over budget
    assert c.messages() == [{"role": "user", "content": "c" * 8}, {"role": "assistant", "content": "d" * 8}]
    assert c.tokens == 4


def test_the_newest_exchange_stays_even_over_budget():
    c = Conversation(max_turns=100, max_tokens=5)
    exchange(c, "x" * 40, "y" * 40)
    assert len(c.messages()) == 2


def test_an_answer_nobody_heard_is_not_kept():
    c = Conversation(max_turns=5)
    exchange(c, "hello", "")
    assert c.messages() == [{"role": "user", "content": "hello"}]


def test_a_reply_revised_to_what_the_client_heard():
    c = Conversation(max_turns=5)
    exchange(c, "q1", "same words")
    exchange(c, "q2", "same words")
    assert c.revise_assistant("same words", "same")  # the latest one
    assert [m["content"] for m in c.messages()] == ["q1", "same words", "q2", "same"]
    assert c.tokens == sum(estimate_tokens(m["content"]) for m in c.messages())
    assert c.revise_assistant("same", "")  # nothing heard: the reply goes, its question stays
    assert [m["content"] for m in c.messages()] == ["q1", "same words", "q2"]
    assert not c.revise_assistant("never said", "x") and c.tokens == sum(estimate_tokens(m["content"]) for m in c.messages())
