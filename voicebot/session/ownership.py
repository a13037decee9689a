"""What a session holds that another session may take: its conversation, kept in the resume store
under its resume token, and the channel it speaks on."""

from __future__ import annotations

from typing import Protocol

from voicebot.channels import ChannelRefused
from voicebot.reply.history import Conversation
from voicebot.runtime import Runtime
from voicebot.session.outbox import Outbox

CONVERSATION_LOST_MESSAGE = (
    "another session resumed this conversation with this session's resume token and holds it now; this session goes "
    "on with an empty conversation that cannot be resumed. If the other session is your own client, close this "
    "one; if not, your resume token is known to someone else: start a new session without it")


class Holder(Protocol):
    """What is used here of a session (voicebot.session.Session)."""

    id: str
    resume_token: str
    conversation: Conversation
    outbox: Outbox

    def lose_conversation(self) -> None: ...


async def resume(rt: Runtime, session: Holder, resume_token: str | None) -> bool:
    """Give `session` the conversation a previous session's resume token names, if the store still
    has it (a client back before its old socket was seen closed takes it from the live session: only
    that client was ever told the token); register the session's own under its own token. True:
    resumed."""
    conversation = await rt.conversations.take(resume_token) if resume_token else None
    if conversation is not None:
        holder = next((s for s in rt.sessions.values() if s is not session and s.resume_token == resume_token), None)
        if holder is not None:  # taken from a session still live here: one conversation, one live session
            conversation = conversation.copy()
            holder.lose_conversation()
        session.conversation = conversation
    rt.conversations.register(session.resume_token, session.conversation)
    return conversation is not None


async def claim_channel(rt: Runtime, session: Holder, channel: str | None, resumed_from: str | None) -> ChannelRefused | None:
    """Make `session` the speaker of `channel`, if it named one; why not, when it may not."""
    if not channel:
        return None
    try:
        await rt.channels.claim(channel, session.id, owner=session.resume_token, resumed_from=resumed_from,
                                tell=session.outbox.error)
    except ChannelRefused as exc:
        return exc
    return None
