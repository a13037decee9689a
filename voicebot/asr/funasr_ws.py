"""The /funasr WebSocket: socket I/O around voicebot.asr.funasr_protocol.

Serves existing FunASR runtime clients with the server's loaded recognizer (same model, same
worker, shared with /v1/voice sessions); utterances end by fsmn-vad when one is configured (as in
the FunASR runtime), else by the server's own Silero endpointer.
"""

from __future__ import annotations

import json

import numpy as np
from fastapi import WebSocket

from voicebot.asr.base import Recognizer
from voicebot.asr.funasr_protocol import FunasrSession, ProtocolError, Segmenter
from voicebot.audio.endpoint import Endpointer, VadEvent
from voicebot.config import EndpointConfig
from voicebot.serving.worker import Worker
from voicebot.transport import Wire, receive_loop


class EndpointerSegmenter:
    """The server's Silero endpointer, run on the audio worker like a /v1/voice session's."""

    def __init__(self, endpointer: Endpointer, worker: Worker) -> None:
        self.endpointer = endpointer
        self.worker = worker

    async def process(self, audio: np.ndarray) -> list[VadEvent]:
        return await self.worker.run(self.endpointer.process, audio)

    async def force_end(self) -> list[VadEvent]:
        return await self.worker.run(self.endpointer.force_end)


def funasr_segmenter(recognizer: Recognizer, endpoint: EndpointConfig, audio_worker: Worker) -> Segmenter:
    """fsmn-vad when the recognizer has one (asr.paraformer.vad_model), else the server's endpointer."""
    vad = getattr(recognizer, "vad", None)  # only the paraformer engine has one
    if vad is not None:
        return vad.segmenter()
    return EndpointerSegmenter(Endpointer(endpoint), audio_worker)


async def serve_funasr(ws: WebSocket, recognizer: Recognizer, segmenter: Segmenter) -> None:
    """Serve one accepted connection until the client goes away."""
    session = FunasrSession(recognizer, segmenter)

    async def on_message(message: Wire) -> None:
        try:
            if isinstance(message, str):
                replies = await session.on_text(message)
            else:
                replies = await session.on_audio(message)
        except ProtocolError as exc:
            replies = [{"wav_name": session.config.wav_name, "error": str(exc), "is_final": False}]
        for reply in replies:
            await ws.send_text(json.dumps(reply, ensure_ascii=False))

    try:
        await receive_loop(ws, on_message)
    finally:
        await session.close()
