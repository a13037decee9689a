"""What a session is doing, and every move it may make between those; any other move is a bug."""

from __future__ import annotations

from enum import Enum


class State(Enum):
    STARTING = "starting"  # connected, waiting for session.start
    LISTENING = "listening"
    THINKING = "thinking"  # a reply is being prepared, no audio sent yet
    SPEAKING = "speaking"
    CLOSING = "closing"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.LISTENING, State.CLOSING}),
    State.LISTENING: frozenset({State.THINKING, State.CLOSING}),
    State.THINKING: frozenset({State.SPEAKING, State.LISTENING, State.CLOSING}),
    State.SPEAKING: frozenset({State.LISTENING, State.CLOSING}),
    State.CLOSING: frozenset(),
}


class NoTransition(RuntimeError):
    """A move TRANSITIONS does not allow: a bug in the session."""


def moved(current: State, to: State) -> State:
    """`to`, when a session may move there from `current`; else NoTransition."""
    if to not in TRANSITIONS[current]:
        raise NoTransition(f"no transition from {current.value} to {to.value}")
    return to
