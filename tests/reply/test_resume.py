"""The store of recent conversations that reconnecting clients resume."""

from __future__ import annotations

import asyncio

from voicebot.reply.history import Conversation
from voicebot.reply.resume import ConversationStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_released_conversation_is_taken_once_within_the_ttl():
    clock = Clock()
    store = ConversationStore(ttl_s=60, max_entries=10, clock=clock)
    conversation = Conversation(5)
    store.register("s1", conversation)
    store.release("s1")
    clock.now = 59
    assert asyncio.run(store.take("s1")) is conversation
    assert asyncio.run(store.take("s1")) is None


def test_an_expired_conversation_is_gone():
    clock = Clock()
    store = ConversationStore(ttl_s=60, max_entries=10, clock=clock)
    store.register("s1", Conversation(5))
    store.release("s1")
    clock.now = 61
    assert asyncio.run(store.take("s1")) is None
    assert len(store) == 0


def test_a_live_session_can_be_taken_over_by_its_reconnecting_client():
    store = ConversationStore(ttl_s=60, max_entries=10)
    conversation = Conversation(5)
    store.register("s1", conversation)
    assert asyncio.run(store.take("s1")) is conversation
    store.release("s1")  # the old socket is finally seen closed: nothing left to keep
    assert len(store) == 0


def test_the_store_is_bounded_oldest_released_first():
    clock = Clock()
    store = ConversationStore(ttl_s=600, max_entries=3, clock=clock)
    for i in range(5):
        store.register(f"s{i}", Conversation(5))
        clock.now += 1
        store.release(f"s{i}")
    assert len(store) == 3
    assert asyncio.run(store.take("s0")) is None and asyncio.run(store.take("s1")) is None
    assert asyncio.run(store.take("s4")) is not None


def test_unknown_ids_resume_nothing():
    assert asyncio.run(ConversationStore(ttl_s=60, max_entries=10).take("nope")) is None
