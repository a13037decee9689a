"""voicebot: a real-time voice server for live streams."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
