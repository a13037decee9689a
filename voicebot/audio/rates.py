"""The two sample rates inside the server, defined once.

Client input arrives at any rate in 8-48 kHz and is resampled (voicebot/audio/resample.py) to
LISTEN_RATE before the gate, the endpointer and the recognizer hear it; every synthesizer speaks at
SPEAK_RATE, the rate of the frames sent back (and of `session.ready`'s output_sample_rate).
"""

LISTEN_RATE = 16000
SPEAK_RATE = 24000
