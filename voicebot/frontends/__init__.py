"""The protocol front ends: each translates one wire format to the session's typed commands
(voicebot.protocol's client messages, voicebot.session.commands) and the session's typed events
(voicebot.session.events) to that wire. None pretends to be a socket, none reaches into a stage.

- voice.py: /v1/voice (its JSON and binary PCM; also what a channel's listeners get)
- realtime_events.py (no I/O; with realtime_session.py, realtime_items.py) and realtime.py: /v1/realtime,
  OpenAI's Realtime protocol
- obs_plugin.py: /obs/audio, the obs-audio-to-websocket plugin
- funasr_protocol.py (no I/O) and funasr_ws.py: /funasr, FunASR's runtime protocol
- openai_audio/: /v1/audio/speech and /v1/audio/transcriptions, OpenAI's HTTP audio routes
- run.py: one speaking session served on one WebSocket, whatever its front end
- handshake.py: the HTTP head deadline (voicebot/transport.py, the receive loop, stays at the root: the
  channel listeners and the cluster use it too, and frontends/ imports session/, which they must not reach)
"""
