"""The session's state machine: every move it may make, every move it refuses, and the typed door
as a session before session.start answers it (no engines: the runtime is not loaded)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.conftest import make_settings
from voicebot.frontends.voice import payload
from voicebot.protocol import ErrorCode, Ping, Say
from voicebot.runtime import Runtime
from voicebot.session import Session, State
from voicebot.session.commands import AnswerText, AudioChunk, SetVadThreshold
from voicebot.session.states import TRANSITIONS, NoTransition, moved

ALLOWED = {
    (State.STARTING, State.LISTENING), (State.STARTING, State.CLOSING),
    (State.LISTENING, State.THINKING), (State.LISTENING, State.CLOSING),
    (State.THINKING, State.SPEAKING), (State.THINKING, State.LISTENING), (State.THINKING, State.CLOSING),
    (State.SPEAKING, State.LISTENING), (State.SPEAKING, State.CLOSING),
}


@pytest.mark.parametrize("current, to", sorted(ALLOWED, key=lambda p: (p[0].value, p[1].value)))
def test_the_moves_a_session_makes(current, to):
    assert moved(current, to) is to


@pytest.mark.parametrize("current, to", [p for p in itertools.product(State, State) if p not in ALLOWED])
def test_every_other_move_is_refused(current, to):
    with pytest.raises(NoTransition, match=f"from {current.value} to {to.value}"):
        moved(current, to)


def test_closing_is_the_end_and_every_state_is_reached_from_starting():
    assert TRANSITIONS[State.CLOSING] == frozenset()
    reached, frontier = {State.STARTING}, [State.STARTING]
    while frontier:
        for state in TRANSITIONS[frontier.pop()] - reached:
            reached.add(state)
            frontier.append(state)
    assert reached == set(State)
    assert all(State.CLOSING in TRANSITIONS[s] for s in State if s is not State.CLOSING)  # a client may leave at any time


def session_before_start() -> tuple[Session, list]:
    delivered: list = []

    async def deliver(message) -> None:
        delivered.append(message)

    return Session(Runtime(make_settings()), deliver), delivered


async def said(session: Session) -> list[dict]:
    out = []
    while not session.outbox.empty():
        out.append(payload(await session.outbox.get()))
    return out


def test_before_session_start_only_ping_is_answered():
    async def scenario():
        session, _ = session_before_start()
        await session.handle(Ping(type="ping", id=7))
        await session.handle(Say(type="say", text="hi"))
        await session.handle(AnswerText("hi"))
        await session.handle(SetVadThreshold(0.6))
        await session.handle(AudioChunk(b"\0\0"))
        return session, await said(session)

    session, out = asyncio.run(scenario())
    assert out[0] == {"type": "pong", "id": 7}
    assert [e["code"] for e in out[1:]] == [ErrorCode.NOT_STARTED] * 4
    assert [e["message"].split(" before")[0] for e in out[1:]] == ["say", "AnswerText", "SetVadThreshold", "audio"]
    assert session.state is State.STARTING and session.turns.empty() and session.audio_in.empty()


def test_close_before_start_is_final_and_idempotent():
    async def scenario():
        session, _ = session_before_start()
        await session.close()
        await session.close()  # a second close is a no-op, not a CLOSING -> CLOSING move
        await session.handle(Ping(type="ping", id="after"))
        return session, await said(session)

    session, out = asyncio.run(scenario())
    assert session.state is State.CLOSING
    assert out == [{"type": "pong", "id": "after"}]  # ping needs no state; the closing owner drops it unsent


def test_a_flood_asks_for_the_close_and_drops_what_follows():
    async def scenario():
        session, _ = session_before_start()
        taken = [session.arrived() for _ in range(5000)]
        return session, taken

    session, taken = asyncio.run(scenario())
    assert not all(taken) and session.watch.close_request is not None
    assert session.watch.close_request[1] == ErrorCode.FLOODING
    first_refused = taken.index(False)
    assert not any(taken[first_refused:])  # closing: every later message refused
