"""A speaking session, whatever its front end: the state machine (machine.py) and its stages.

    front end ─► Session.handle(command) ─► audio_in (AudioIn, InputEnd, DropUtterance)
      ─► listening.Listening: FrontEnd (resample ─► gate ─► endpoint) ─► recognizer ─► Utterance
      ─► turn_taking.TurnTaking (silence rule or end-of-turn model) ─► turns (Turn)
      ─► replying.Reply: responder ─► TTS (SpeechChunk) ─► Framer ─► Pacer ─► outbox (AudioFrame)
    front end ◄── Session.run_sender ◄── outbox (events.* and AudioFrame)

Commands in: commands.Command; events out: events.ServerEvent. No wire format here: the front
ends (voicebot/frontends/) translate. docs/architecture.md walks one chunk through it and lists
every bound.
"""

from voicebot.session.machine import State, Session

__all__ = ["Session", "State"]
