"""Input the front end failed on, or the input clock had no room for: lost, told and counted."""

from __future__ import annotations

import logging

from voicebot.messages import AudioIn, Inbound
from voicebot.metrics import Metrics
from voicebot.protocol import ErrorCode
from voicebot.serving.input_clock import InputOverloaded
from voicebot.session.listening import Listening
from voicebot.session.outbox import Outbox

log = logging.getLogger("voicebot.session")


async def lose_chunks(item: Inbound | list[AudioIn], exc: Exception, listening: Listening, outbox: Outbox, metrics: Metrics,
                      session_id: str, sample_rate: int, retry_after_s: float) -> None:
    """The chunks of `item` are lost, and so is the utterance they were part of: the client is told,
    both are counted as dropped input, and the next utterance is heard afresh. An overload is the
    server's capacity, not a broken engine: `busy` with a retry-after, as admission answers,
    counted apart."""
    overloaded = isinstance(exc, InputOverloaded)
    reason = "overload" if overloaded else "engine_error"
    if overloaded:
        log.warning("the input path is full; a chunk of session %s is dropped: %s", session_id, exc)
        metrics.engine_overloads.labels("vad").inc()
    else:
        log.error("the front end failed on a chunk in session %s", session_id, exc_info=exc)
        metrics.engine_failures.labels("vad", "chunk").inc()
    utterance_id = await listening.lose_open(reason)
    chunk_s = sum(len(c.pcm) for c in item) / (2 * sample_rate) if isinstance(item, list) else 0.0
    metrics.input_dropped.labels(reason).inc(chunk_s)
    lost = f"; utterance {utterance_id} is lost" if utterance_id else ""
    where = {"engine": "vad", "stage": "chunk", **({"utterance_id": utterance_id} if utterance_id else {})}
    if overloaded:
        await outbox.error(ErrorCode.BUSY, f"voice detection is at capacity; a chunk of input was dropped{lost}",
                           retry_after_s=retry_after_s, overloaded="input", **where)
    else:
        await outbox.error(ErrorCode.ENGINE_ERROR, f"voice detection failed on a chunk of input{lost}: {exc}", **where)
