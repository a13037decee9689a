"""The /funasr WebSocket: socket I/O around voicebot.frontends.funasr_protocol.

Serves existing FunASR runtime clients with the server's loaded recognizer (same model, same
worker, shared with /v1/voice sessions); utterances end by fsmn-vad when one is configured (as in
the FunASR runtime), else by the server's own Silero endpointer. The same limits as a session's:
the flood guard (with `limits.funasr_audio_burst_s` for PCM sent faster than real time; a whole
file's bytes are bounded by MAX_FILE_BYTES instead) and the idle timeout. Refusals at admission
(busy, unauthorized, ...) are sent in FunASR's result shape (`RefusingInFunasrShape`).

Receiving and handling are apart, as a /v1/voice session's are (its audio_in queue): the receive
loop stamps each message's arrival and puts it in the connection's `Backlog`; one task handles
them in order, the binary messages that waited together in one trip through the segmenter and the
recognizer (a stream that fell behind catches up at once instead of a trip per message, each
waiting for the last). A message's input lag is counted from its arrival (FunasrSession.on_audio),
so time spent waiting behind the messages before it is seen by admission control, not hidden in
the socket's buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from fastapi import WebSocket, WebSocketDisconnect

from voicebot.asr.base import Recognizer
from voicebot.audio.endpoint import SAMPLE_RATE, WINDOW, Endpointer, VadEvent
from voicebot.config import Settings
from voicebot.config.stages import EndpointConfig
from voicebot.frontends.funasr_config import FunasrMessageError
from voicebot.frontends.funasr_protocol import OFFLINE, EngineFailed, FunasrSession, Segmenter
from voicebot.guards.flood import FloodGuard
from voicebot.guards.idle import IdleWatch
from voicebot.metrics import Metrics
from voicebot.protocol import MAX_CHUNK_SECONDS, CloseCode, ErrorCode
from voicebot.serving.lateness import InputLag
from voicebot.serving.vad import VadBatcher
from voicebot.transport import Wire, is_closed, receive_loop

log = logging.getLogger(__name__)

# The most windows one request to the VAD batcher holds: a session's largest chunk (1 s).
MAX_CHUNK_WINDOWS = int(SAMPLE_RATE * MAX_CHUNK_SECONDS) // WINDOW
# A connection's messages received and not yet handled, at most: this many bytes (1 MiB: 33 s of
# 16 kHz PCM; one message more whatever its size, so that one bigger than the bound still passes,
# and a message is at most protocol.MAX_MESSAGE_BYTES) and this many messages. Past either, the
# receive loop waits for room and the client's socket holds what it sends.
BACKLOG_BYTES = 2**20
BACKLOG_MESSAGES = 256


@dataclass(frozen=True)
class Received:
    message: Wire
    arrived: float  # monotonic time it came off the socket


class Backlog:
    """A connection's messages received and not yet handled, in order (bounds: BACKLOG_BYTES,
    BACKLOG_MESSAGES). One receiving task puts, one handling task takes, on the event loop."""

    def __init__(self) -> None:
        self._waiting: deque[Received] = deque()
        self._bytes = 0  # a text message counts its characters
        self._closed = False
        self._room = asyncio.Event()  # set when a put may go on
        self._room.set()
        self._arrived = asyncio.Event()  # set when a take may go on

    def __len__(self) -> int:
        return len(self._waiting)

    def _has_room(self) -> bool:
        return not self._waiting or (self._bytes < BACKLOG_BYTES and len(self._waiting) < BACKLOG_MESSAGES)

    async def put(self, message: Wire) -> Received | None:
        """Stamped with its arrival, then queued once there is room; None if kept out: the backlog
        was closed meanwhile (the message is returned to be counted)."""
        received = Received(message, time.monotonic())  # its arrival, before any wait for room
        while not (self._has_room() or self._closed):
            self._room.clear()
            await self._room.wait()
        if self._closed:
            return received
        self._waiting.append(received)
        self._bytes += len(message)
        self._arrived.set()
        return None

    async def take(self) -> list[Received]:
        """The next text message alone, or every binary message waiting before the next text one;
        nothing once closed."""
        while not (self._waiting or self._closed):
            self._arrived.clear()
            await self._arrived.wait()
        if not self._waiting:
            return []
        taken = [self._waiting.popleft()]
        while isinstance(taken[0].message, bytes) and self._waiting and isinstance(self._waiting[0].message, bytes):
            taken.append(self._waiting.popleft())
        self._bytes -= sum(len(r.message) for r in taken)
        self._room.set()
        return taken

    def close(self) -> list[Received]:
        """No more puts or takes: what was left unhandled, taken out."""
        left, self._waiting, self._bytes, self._closed = list(self._waiting), deque(), 0, True
        self._room.set()
        self._arrived.set()
        return left


class EndpointerSegmenter:
    """The server's Silero endpointer, its windows judged by the VAD batcher in the same calls as
    every other stream's (/v1/voice sessions' and other /funasr clients'), so they share its
    onnxruntime calls and count in its load (voicebot/serving/vad.py).

    Cutting windows and the endpoint rule are a few numpy operations per chunk: they run here on the
    loop, as a session's rule does (FunasrSession resamples on the loop already). A chunk is sent in
    pieces of at most MAX_CHUNK_WINDOWS, so one request holds what the batcher's bound assumes (a
    /funasr client may send seconds in one message; a file is segmented in 1 s pieces)."""

    def __init__(self, endpointer: Endpointer, vad: VadBatcher) -> None:
        self.endpointer = endpointer
        self.vad = vad

    async def process(self, audio: np.ndarray) -> list[VadEvent]:
        windows = self.endpointer.cut(audio)
        probabilities = [await self.vad.probabilities(self.endpointer.vad, windows[start : start + MAX_CHUNK_WINDOWS])
                         for start in range(0, len(windows), MAX_CHUNK_WINDOWS)]
        return self.endpointer.decide(windows, np.concatenate(probabilities or [np.zeros(0, np.float32)]))

    async def force_end(self) -> list[VadEvent]:
        return self.endpointer.force_end()


def funasr_segmenter(recognizer: Recognizer, endpoint: EndpointConfig, vad: VadBatcher) -> Segmenter:
    """fsmn-vad when the recognizer has one (asr.paraformer.vad_model), else the server's endpointer."""
    fsmn = getattr(recognizer, "vad", None)  # only the paraformer engine has one
    if fsmn is not None:
        return fsmn.segmenter()
    return EndpointerSegmenter(Endpointer(endpoint), vad)


async def serve_funasr(ws: WebSocket, recognizer: Recognizer, segmenter: Segmenter, settings: Settings, metrics: Metrics,
                       input_lag: InputLag | None = None) -> None:
    """Serve one accepted connection until the client goes away, floods, goes quiet for
    `server.idle_timeout_s` or an engine fails on its stream; those end it as a refused stream ends
    (the results so far, then the reason as an error result), and close it (docs/funasr.md). A VAD
    with no room is not a failure: the session answers it and the stream goes on. What was received
    and not handled when it ends is counted as dropped input, by why it ended."""
    session = FunasrSession(recognizer, segmenter, metrics, input_lag)
    limits = settings.limits
    flood = FloodGuard(limits.max_messages_per_s, limits.max_audio_realtime_factor, limits.window_s,
                       audio_burst_s=limits.funasr_audio_burst_s)
    backlog = Backlog()
    handling = False  # messages are being recognised (a whole file can take a while): not idle
    idle = IdleWatch(settings.server.idle_timeout_s, busy=lambda: handling or bool(backlog))
    flooding: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    broken: asyncio.Future[EngineFailed] = asyncio.get_running_loop().create_future()
    gone = False  # a send found the client gone

    async def on_message(message: Wire) -> None:
        idle.heard()
        if kept_out := await backlog.put(message):  # the handling task is gone
            drop([kept_out], ended() or "client_gone")

    def audio_bytes(message: Wire) -> int:
        # A file's bytes are not PCM: MAX_FILE_BYTES bounds them, not the audio rate.
        return len(message) if isinstance(message, bytes) and not session.takes_file else 0

    def drop(left: list[Received], reason: str) -> None:
        """Counted as PCM at audio_fs, a compressed file's bytes too."""
        metrics.input_dropped.labels(reason).inc(sum(len(r.message) for r in left if isinstance(r.message, bytes))
                                                 / (2 * session.config.audio_fs))

    def ended() -> str | None:
        """Why the stream has ended, if it has: what is received from then on is dropped, counted by it."""
        return "engine_error" if broken.done() else "flooding" if flooding.done() else "client_gone" if gone else None

    async def handle_all() -> None:
        """The backlog, in order, until it is closed; once the stream has ended, only counted (the
        receive loop may be waiting for room: it must get it, to see the end)."""
        nonlocal handling, gone
        while taken := await backlog.take():
            if reason := ended():
                drop(taken, reason)
                continue
            handling = True
            try:
                # The flood guard sees each message at its arrival, as if it had been checked then.
                for k, received in enumerate(taken):
                    if why := flood.check(audio_bytes(received.message), session.config.audio_fs, received.arrived):
                        await handle(taken[:k])
                        drop(taken[k:], "flooding")
                        flooding.set_result(f"flooding: {why}")  # the receive loop ends here
                        break
                else:
                    await handle(taken)
            except WebSocketDisconnect:
                gone = True  # the receive loop sees it too
            except RuntimeError:
                if not is_closed(ws):
                    raise
                gone = True
            finally:
                handling = False

    async def handle(taken: list[Received]) -> None:
        """One text message, or binary messages joined, and the replies sent."""
        if not taken:
            return
        try:
            if isinstance(taken[0].message, str):
                replies = await session.on_text(taken[0].message)
            else:
                replies = await session.on_audio(b"".join(r.message for r in taken), [r.arrived for r in taken])
        except FunasrMessageError as exc:
            replies = [{"wav_name": session.config.wav_name, "error": str(exc), "is_final": False}]
        except EngineFailed as exc:  # the VAD or the recognizer broke on this stream: it ends, the server goes on
            log.error("/funasr: an engine failed on stream %r: %s", session.config.wav_name, exc, exc_info=exc.__cause__)
            metrics.engine_failures.labels(exc.engine, exc.stage).inc()
            broken.set_result(exc)  # the receive loop ends here
            return
        for reply in replies:
            await ws.send_text(json.dumps(reply, ensure_ascii=False))

    handler = asyncio.create_task(handle_all())
    # Should it die (a bug: raised below), the receive loop must not wait for room for ever.
    handler.add_done_callback(lambda _: drop(backlog.close(), ended() or "client_gone"))
    quiet = asyncio.create_task(idle.expire())
    try:
        await receive_loop(ws, on_message, until=(flooding, quiet, broken, handler))
        left = backlog.close()
        await handler  # its trip in progress, if any, ends (a bug in it is raised here)
        drop(left, ended() or "client_gone")
        if broken.done():
            failed = broken.result()
            await _end(ws, session, metrics, ErrorCode.ENGINE_ERROR, f"an engine failed: {failed}", CloseCode.INTERNAL_ERROR,
                       engine=failed.engine, stage=failed.stage)
        elif flooding.done():
            await _end(ws, session, metrics, ErrorCode.FLOODING, flooding.result(), CloseCode.FLOODING)
        elif quiet.done():
            await _end(ws, session, metrics, ErrorCode.IDLE_TIMEOUT, quiet.result(), CloseCode.POLICY)
    finally:
        quiet.cancel()
        handler.cancel()
        await session.close()


async def _end(ws: WebSocket, session: FunasrSession, metrics: Metrics, code: str, reason: str, close_code: int,
               **extra: str) -> None:
    """The results of the audio received so far, the reason as the final result (with `extra`
    fields), then the close."""
    metrics.errors.labels(code).inc()
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the client may be gone already
        try:
            replies = await session.refuse(reason)
        except EngineFailed as exc:  # the engine that broke the stream fails on its rest too: only the error is sent
            log.warning("/funasr: the results so far could not be made: %s", exc)
            replies = [session.error_result(reason)]
        replies[-1] |= extra
        for reply in replies:
            await ws.send_text(json.dumps(reply, ensure_ascii=False))
        await ws.close(close_code, code)


class RefusingInFunasrShape:
    """The WebSocket as admission (voicebot.app admit, voicebot.auth) uses it, with its refusals
    (voicebot error events: busy, unauthorized, ...) sent as the FunASR runtime ends a stream: a
    final `2pass-offline` result whose `text` is `ERROR. <why>`. The runtime's clients and HTML5
    page read `mode`, `wav_name`, `text` and `is_final` of every message (a voicebot error event
    has none of them: a traceback in the Python client, "undefined" on the page); the event's own
    fields (`error`, `code`, `retry_after_s`, ...) come along for clients that read them."""

    def __init__(self, ws: WebSocket) -> None:
        self._ws = ws

    def __getattr__(self, name: str):
        return getattr(self._ws, name)

    async def send_json(self, data: dict) -> None:
        await self._ws.send_json(funasr_refusal(data))


def funasr_refusal(event: dict) -> dict:
    """A voicebot error event as FunASR's error result (see RefusingInFunasrShape)."""
    extra = {k: v for k, v in event.items() if k not in ("type", "message")}
    return {"mode": OFFLINE, "wav_name": "", "text": f"ERROR. {event['message']}", "is_final": True,
            "error": event["message"]} | extra
