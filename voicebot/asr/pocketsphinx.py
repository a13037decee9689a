"""pocketsphinx: English recognition that needs no downloads (its model ships in the wheel).

With `phrases` configured it decodes against a closed JSGF grammar of those phrases: deterministic,
for tests and demos. Without, it uses its general English language model: honest but weak
(20-35 % of words right on synthetic speech). Each stream decodes on a decoder borrowed from a pool
(voicebot/asr/pocketsphinx_decoders.py) for its life, one chunk per call, a partial at most every
200 ms, no search after the utterance (each call kept short).

Where the decoders live (`asr.pocketsphinx.processes`):
- in decoding processes (the default; voicebot/asr/pocketsphinx_process.py): the binding holds the
  GIL for a whole call, but a child's own. A stream is bound when it opens, for its life, to a
  process with an idle decoder, else one where no stream is speaking, else the one with the fewest
  streams (each the fewest streams among them); the `decoders` pool is split among the processes,
  and each keeps what it builds for its peak. A stream that would need a decoder built while a
  stream speaks on every process is not let in (`full`: admission answers `busy`, reason
  `decoders`): the build would hold that process for 0.2-0.6 s, every stream bound there waiting
  behind it (bench/pocketsphinx_burst.py --joining). A stream whose
  process was lost (died, or hung past a request's deadline and killed) fails its utterance in
  progress (the session's `engine_error`), and its reset (the session runs one after a failure)
  binds it to a live process.
- in the server's process (`processes: 0`), on two worker threads: every call holds the server's
  GIL, so the event loop and every session's audio pacing wait out each one (a Decoder's build,
  0.2-0.6 s; one thread decoding 10 s of audio in one call kept the loop off for 2.4 s), and the
  two threads never decode at once.

The cepstral mean a decoder starts from (see pocketsphinx_decoders.py) is the server's last finished
utterance's, whichever process finished it: each final brings it back, each open and renew takes it
along, so only the first utterance after start-up is decoded cold.
"""

from __future__ import annotations

import asyncio
import math
import os
from itertools import count

import numpy as np

from voicebot.asr.base import Hypothesis, Recognizer, RecognizerStream
from voicebot.asr.pocketsphinx_decoders import PARTIAL_INTERVAL_SAMPLES, Decoders, Transcriber, model_name
from voicebot.asr.pocketsphinx_process import LOSS_CAUSES, DecoderProcess, DecoderProcessLost, start_all
from voicebot.config.engines import PocketsphinxConfig
from voicebot.engine_reports import EngineInfo, ResetReport
from voicebot.metrics import register_processes_lost
from voicebot.serving.worker import Worker

__all__ = ["PARTIAL_INTERVAL_SAMPLES", "PocketsphinxRecognizer"]

# `processes` when not configured: one per core the server may run on (a process decodes on one core
# at a time; more than the cores decode no more at once), at most this many. The general LM costs about
# half a core per stream speaking (bench/pocketsphinx_burst.py: 0.46 CPU s per s of audio; a grammar,
# 0.015), and a show's guests take turns, so 4 keep up with a show; each costs its own interpreter
# (24 MB) and at least one idle decoder (a child with one: 119 MB with the LM, 52 MB with a grammar).
# A box meant for many speakers at once raises it, up to its cores (admission control watches each
# process's load).
MAX_AUTO_PROCESSES = 4

# `decoders` when not configured: as many as fit in this much resident memory. A burst of connects
# beyond the pool stalls the streams already speaking on each child by every build it needs (0.2-0.6
# s of CPU each, pocketsphinx holding the child's GIL: 16 connects in 0.8 s on 4 decoders stalled a
# speaking stream's feeds 3-4 s on this 2-core box, none past 20 ms on 16), so the pool should cover
# the burst admission lets in; beyond it, a stream is let in only while a child has nobody speaking
# (`full`: 24 live speakers on a pool of 16 let in all 24 to an input lag p95 of 1.85 s; refused, 8
# of them, to 0.15 s), and the pool the children grow to is kept. With a grammar (0.015 CPU s per s of speech) two children hold 16
# speakers and more: 17 decoders, 459 MB. With the general LM (0.46 CPU s per s) two children keep up
# with about 4 people speaking at once, so admission lets in far fewer: 5 decoders, 450 MB. Split
# among the children rounding down (2 children: 16 with a grammar, 4 with the LM), built at start-up
# side by side (0.2-0.6 s each).
POOL_MB = 480
DECODER_MB = {"grammar": 27, "lm": 90}  # resident, each
# `full`'s retry hint when every process has a stream speaking and none an idle decoder: about one
# utterance, after which a process's streams may all be quiet (a build there stalls no speech).
FULL_RETRY_AFTER_S = 3.0


def default_decoders(phrases: list[str]) -> int:
    return POOL_MB // DECODER_MB["grammar" if phrases else "lm"]


def default_processes() -> int:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
    return max(1, min(usable or 1, MAX_AUTO_PROCESSES))


def to_pcm16(pcm: np.ndarray) -> bytes:
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


class PocketsphinxRecognizer(Recognizer):
    name = "pocketsphinx"

    def __init__(self, config: PocketsphinxConfig) -> None:
        self.config = config
        self.model = model_name(config.phrases)
        self._loaded = False
        children = default_processes() if config.processes is None else config.processes
        pool = config.decoders or default_decoders(config.phrases)
        if children:
            # The pool, split: at least one idle each; the default's rounded down, within POOL_MB.
            keep = math.ceil(pool / children) if config.decoders else max(1, pool // children)
            self.processes = [DecoderProcess(i, config.phrases, config.second_pass, keep) for i in range(children)]
            self.cepstral_mean: str | None = None  # of the server's last finished utterance
            self._stream_ids = count()
        else:
            self.processes = []
            self.worker = Worker("pocketsphinx", threads=2)
            self.decoders = Decoders(config.phrases, config.second_pass, pool, self.worker.submit)

    def load(self) -> None:
        if self.processes:
            start_all(self.processes)
        else:
            self.decoders.load()
        self._loaded = True

    def open(self, language: str | None = None) -> RecognizerStream:
        if self.processes:
            return ProcessStream(self)
        return ThreadStream(self)

    def least_loaded(self) -> DecoderProcess:
        """Where a new stream goes: a process with an idle decoder, else one where no stream is
        speaking (its build delays no speech), else any; the fewest streams among them."""
        return min(self.processes, key=lambda process: (process.idle <= 0, process.speaking > 0, process.streams))

    def full(self) -> float | None:
        """Seconds to retry after when a new stream would need a decoder built while a stream speaks
        on every process (see the module doc), else None. On the server's threads (`processes: 0`)
        never: there a build holds the server's GIL whenever it runs."""
        if not self.processes:
            return None
        process = self.least_loaded()
        return None if process.idle > 0 or not process.speaking else FULL_RETRY_AFTER_S

    def info(self) -> EngineInfo:
        details = {"model": self.model, "phrases": len(self.config.phrases), "processes": len(self.processes)}
        if self.processes:
            details["processes_lost"] = sum(self.processes_lost().values())
            # Decoders in the children (what they built for their peaks kept), idle ones, and those
            # built after start-up for streams beyond the pool (each held its child 0.2-0.6 s).
            details["decoders"] = sum(process.decoders for process in self.processes)
            details["decoders_idle"] = sum(max(process.idle, 0) for process in self.processes)
            details["decoders_built"] = sum(process.built for process in self.processes)
        return EngineInfo("asr", self.name, "cpu", self._loaded, details)

    def processes_lost(self) -> dict[str, int]:
        """Decoding children lost under the server, by cause (died, hung)."""
        return {cause: sum(process.lost[cause] for process in self.processes) for cause in LOSS_CAUSES}

    def register_metrics(self, registry) -> None:
        if self.processes:
            register_processes_lost(registry, self.name, self.processes_lost)

    def workers(self) -> list[Worker | DecoderProcess]:
        # A process's load, for admission control, is its child's CPU time answering requests.
        return self.processes or [self.worker]

    def close(self) -> None:
        if self.processes:
            for process in self.processes:
                process.close()
        else:
            self.worker.shutdown()
            self.decoders.clear()


def _hypothesis(text: str, model: str) -> Hypothesis:
    # pocketsphinx's posterior needs a lattice it does not build in streaming mode (it always reads
    # 1.0): no confidence rather than a meaningless one.
    return Hypothesis(text, None, model, token_count=len(text.split()))


class ProcessStream(RecognizerStream):
    """A stream whose decoder lives in a decoding process (see the module doc)."""

    def __init__(self, engine: PocketsphinxRecognizer) -> None:
        self.engine = engine
        self.id = next(engine._stream_ids)
        self.generation = 0  # of resets
        self._bind(engine.least_loaded())

    @property
    def pool(self) -> str:
        """Where this stream decodes: what its input lag is reported by (voicebot/serving/capacity.py)."""
        return self.process.name

    def _bind(self, process: DecoderProcess) -> None:
        self.process = process
        process.streams += 1
        # Sent with the child's next batch, answered at once (the child builds the stream's decoder
        # between requests if none is idle); the child's generation it opened on comes back.
        self._opened = process.queue_open(self.id, self.engine.cepstral_mean)
        self._opened_on: int | None = None

    async def _child(self) -> int:
        """The generation of the child this stream is bound to (raises if it could not open there)."""
        if self._opened_on is None:
            self._opened_on = await asyncio.wrap_future(self._opened)
        return self._opened_on

    async def accept(self, pcm: np.ndarray) -> str | None:
        return await self.process.run(await self._child(), ("feed", self.id, to_pcm16(pcm)))

    async def finish(self) -> Hypothesis:
        text, cepstral_mean = await self.process.run(await self._child(), ("finish", self.id, None))
        self.engine.cepstral_mean = cepstral_mean
        return _hypothesis(text, self.engine.model)

    async def reset(self) -> ResetReport:
        try:
            child = await self._child()
        except Exception:  # noqa: BLE001 -- it never opened (that failure was reported): nothing to renew
            child = None
        try:
            renewed = child is not None and await self.process.run(child, ("renew", self.id, self.engine.cepstral_mean))
        except DecoderProcessLost:
            renewed = False
        if not renewed:  # its process was lost, and its decoder with it: a new one, on a live process
            self.process.streams -= 1
            self._bind(self.engine.least_loaded())
            await self._child()
        self.generation += 1
        return ResetReport(self.engine.name, self.generation, 1)

    async def close(self) -> None:
        self.process.streams -= 1
        try:
            child = await self._child()
        except Exception:  # noqa: BLE001 -- it never opened (that failure was reported): nothing to give back
            return
        try:
            if child == self.process.generation:
                await self.process.run(child, ("close", self.id, None))
        except DecoderProcessLost:
            pass  # its decoder went with its process: nothing to give back


class ThreadStream(RecognizerStream):
    """A stream whose decoder lives in the server's process, called on the engine's worker threads."""

    pool = "pocketsphinx"  # its worker threads: what its input lag is reported by

    def __init__(self, engine: PocketsphinxRecognizer) -> None:
        self.engine = engine
        # Borrowing builds a decoder (~0.3 s) if none is idle: started now, off the loop.
        self._transcriber = engine.worker.submit(Transcriber.borrowing, engine.decoders)
        self.generation = 0

    def _on_transcriber(self, method, *args):
        return method(self._transcriber.result(), *args)  # on the worker: after the borrow queued first

    async def _run(self, method, *args):
        return await self.engine.worker.run(self._on_transcriber, method, *args)

    async def accept(self, pcm: np.ndarray) -> str | None:
        return await self._run(Transcriber.feed, to_pcm16(pcm))

    async def finish(self) -> Hypothesis:
        return _hypothesis(await self._run(Transcriber.finish), self.engine.model)

    async def reset(self) -> ResetReport:
        await self._run(Transcriber.renew)
        self.generation += 1
        return ResetReport(self.engine.name, self.generation, 1)

    async def close(self) -> None:
        await self._run(Transcriber.close)
