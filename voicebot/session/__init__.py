"""A /v1/voice session: the state machine (machine.py) and the two stages it runs.

    socket ─► transport.receive_loop ─► Session.on_message ─► audio_in (AudioIn)
      ─► listening.Listening: FrontEnd (resample ─► gate ─► endpoint) ─► recognizer ─► Utterance
      ─► Session._on_utterance ─► turns (Turn)
      ─► replying.Reply: responder ─► TTS (SpeechChunk) ─► Framer ─► Pacer ─► outbox (AudioFrame)
    socket ◄── Session.run_sender ◄──┘

docs/architecture.md walks one chunk through it and lists every bound.
"""

from voicebot.session.machine import State, Session

__all__ = ["Session", "State"]
