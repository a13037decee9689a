"""Our own streaming Paraformer (FunASR's SANM encoder, CIF predictor and SANM decoder), batched.

model.py: the network and the batched chunk step; frontend.py: fbank + LFR + CMVN; loader.py:
FunASR model directories; stream.py: funasr's streaming loop (pieces, flush, reset) per stream.

Named after the architecture (SANM) rather than `paraformer` so voicebot/asr/paraformer.py, the
funasr-based engine that stays selectable, keeps its name and its importers.
"""
