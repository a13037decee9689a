"""pocketsphinx's decoders in processes of their own, so that no decoding call holds the server's GIL.

pocketsphinx's binding keeps the GIL for a whole call (a thread decoding 10 s of audio in one call
kept the event loop off for 2.4 s; building a Decoder, 0.2-0.6 s): on the server's worker threads,
every session's audio pacing waits out every call, and two threads never decode at once. Here each
`DecoderProcess` is one child interpreter holding a `Decoders` pool (voicebot/asr/pocketsphinx_decoders.py, whose `serve` is its loop)
and the streams bound to it for their life; the server sends it one request at a time over a pipe
(open, feed a chunk, finish, renew, close) and reads the answer, on a thread of its own (a `Worker`
of one thread: the blocking send and recv release the GIL), so the event loop never waits for it.

The child is spawned, never forked (a fork of a process with threads can inherit a lock another
thread held), as `python -m voicebot.asr.pocketsphinx_decoders` (its `serve` is the child's loop): it
imports that module and pocketsphinx, nothing of the server. (multiprocessing's spawn would also run the
server's main script again in the child.) It exits when its pipe closes, so a server killed
outright leaves no child behind.

Feeds are batched: a stream's feed joins the process's queue of feeds, and one call on the worker
takes every feed queued there, of every stream bound here, to the child as one request ("batch"),
whose answer holds each feed's (`feed_batches` counts the feeds per batch). So the streams of a
process cost one round trip per batch, not one per chunk per stream: while the child decodes one
batch, the next gathers, and a stream's next chunk waits at most for the batch in flight. A
stream's open goes the same way, with the next batch: the child answers it without building a
decoder (one with none idle waits for its own, built between requests), so a burst of connects puts
no round trip, and no build, ahead of the speaking streams' feeds.

Bounds: one request in flight per process (its worker has one thread), so the pipe holds at most
one request, of at most 1 s of audio for a lone request (`MAX_FEED_BYTES`: a longer feed goes as
several) and `MAX_BATCH_BYTES` of audio for a batch (a bigger one goes as several requests); a
stream awaits each call, so it has at most one request queued or in flight, and the feed queue at
most one feed per stream bound here. A child holds max(`keep`, the most streams bound to it at once)
decoders, kept (voicebot/asr/pocketsphinx_decoders.py); `decoders` is the server's count of them.

A child is lost when it dies (killed, crashed: noticed at the next request to it, or by the request
it was answering) or hangs (alive but silent past its request's deadline, `answer_deadline_s`: a
decoder stuck in C, a SIGSTOP; it is killed). Either way that request, and every later one of a
stream that was bound to it, fails with `DecoderProcessLost` (the session reports a recognizer
failure, loses that utterance, and its reset binds the stream to a live process: see
PocketsphinxRecognizer); the loss is counted by cause (`lost`: /readyz `processes_lost`,
voicebot_decoder_processes_lost_total) and a new child is started at once, so the next stream works.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import subprocess
import sys
import threading
from collections import Counter
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

from voicebot.asr import pocketsphinx_decoders as decoders_module
from voicebot.serving.worker import Worker

log = logging.getLogger("voicebot.asr")

# A child builds its first decoders before it answers: 0.3 s each on an idle core, a few times
# that on a loaded box; past this it counts as failed to start.
START_TIMEOUT_S = 60.0
# After SIGTERM at shutdown, a child is given this long before SIGKILL.
STOP_TIMEOUT_S = 5.0

# A request's deadline: past it the child counts as hung (killed, replaced, its streams failed).
# Generous, since a false alarm costs every stream on the child its utterance in progress, while a
# real hang only has to be ended within seconds. Measured on this 2-core box at load 6 (four
# developers' jobs): a Decoder's build took 0.5-0.6 s of CPU and up to 2.1 s of wall time with the
# general LM (0.15-0.2 s with a grammar); 6.5 s of audio fed in one call took 3.2 s of CPU and 5.9 s
# of wall time with the LM (0.2 s with a grammar), and its end of utterance 0.16 s.
# Any request may wait behind one build the child runs between requests (for a stream waiting for
# its decoder), and run one itself (that stream's finish, or its feed past the audio held for it):
# two builds, 4.2 s at that worst, so a floor of 15 s (3.5 times that).
ANSWER_FLOOR_S = 15.0
# On top, per second of the audio the request decodes (a feed's chunk; for a finish, renew or close,
# which end the utterance, the utterance so far: the best path and the LM's second pass search it
# again): 4 s, four times the worst wall time measured (0.9 s per s of audio). The clock starts at
# the send, so a request's wait in its worker's queue behind other streams' is not counted: 16 LM
# streams at once on one child (bench/pocketsphinx_burst.py --model lm --streams 16) finished at
# p95 0.6 s, far inside.
ANSWER_S_PER_AUDIO_S = 4.0
SAMPLE_RATE = 16000
# The most audio one request carries: 1 s of s16le (32 KB). The socket's buffer (about 200 KB)
# takes it whole, so a send never blocks on a hung child, which only its answer's deadline watches.
MAX_FEED_BYTES = 2 * SAMPLE_RATE
# The most audio one batch of feeds carries (64 KB: 50 streams' 20 ms chunks): under the socket's
# buffer, as MAX_FEED_BYTES is.
MAX_BATCH_BYTES = 2 * MAX_FEED_BYTES
# Why a child was lost: it exited, or it hung (no answer by the deadline) and was killed.
LOSS_CAUSES = ("died", "hung")


class DecoderProcessLost(RuntimeError):
    """The process holding a stream's decoder died, or hung and was killed; the stream's utterance went with it."""


class DecoderProcess:
    """One decoding child and the server's side of its pipe (blocking calls: on `worker`)."""

    threads = 1  # for admission control (voicebot/serving/capacity.py): one core's worth of decoding

    def __init__(self, index: int, phrases: list[str], second_pass: bool, keep: int) -> None:
        self.name = f"pocketsphinx-{index}"
        self._options = {"phrases": phrases, "second_pass": second_pass, "keep": keep}
        self.keep = keep  # decoders its child builds at start-up
        # One thread: a request, then its answer, one at a time on the pipe. Its queue holds at most
        # one call per stream bound here (each stream awaits its calls).
        self.worker = Worker(self.name, threads=1)
        self._child: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.generation = 0  # which child: one more at each loss; a stream's requests name theirs
        self.streams = 0  # streams bound here (on the event loop: PocketsphinxRecognizer.open)
        self.lost = dict.fromkeys(LOSS_CAUSES, 0)  # children lost under the server, by cause
        # Samples fed to each bound stream's utterance in progress, for its end's deadline (on
        # `worker`; one entry per stream bound to this child).
        self._utterance_samples: dict[int, int] = {}
        self.busy_s = 0.0  # the children's CPU seconds answering requests, for admission control
        self.built = 0  # decoders its children built after start-up (for streams beyond the pool)
        # The live child's decoders as its answers told them (a build it has not told yet is not
        # counted: `idle` errs low). It frees none: it keeps what it built for its peak.
        self.decoders = keep
        self._closing = False
        # Feeds and opens waiting for the next batch: (generation, None for an open; request; its
        # future); at most one per stream bound here (its open comes back before its first feed).
        # `_batch_queued`: a batch call is on the worker's queue and has not taken them yet.
        self._feeds: list[tuple[int | None, tuple, concurrent.futures.Future]] = []
        self._feeds_lock = threading.Lock()
        self._batch_queued = False
        self.feed_batches: Counter[int] = Counter()  # requests per batch: feeds, and the opens that went with them

    @property
    def idle(self) -> int:
        """Decoders no stream bound here holds, as far as the child's answers told (read on the loop)."""
        return self.decoders - self.streams

    @property
    def speaking(self) -> int:
        """Streams bound here with an utterance in progress (fed since it began; read on the loop)."""
        return len(self._utterance_samples)

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child else None

    def spawn(self) -> None:
        """Start the child (blocking, brief); `await_ready` waits for its decoders."""
        ours, theirs = Pipe()
        # The child imports the same voicebot as the server, wherever the server found it.
        source = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
        self._child = subprocess.Popen(
            [sys.executable, "-m", decoders_module.__name__, str(theirs.fileno()), json.dumps(self._options)],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()  # the child's now: its pipe closes when it dies, and ours reads EOF
        self._conn = ours
        self.decoders = self.keep

    def await_ready(self) -> None:
        """Wait until the child has built its decoders; raises (the child killed) if it cannot."""
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise RuntimeError(f"{self.name} built no decoders in {START_TIMEOUT_S:.0f} s")
            status, detail = self._conn.recv()
            if status != "ready":
                raise RuntimeError(f"{self.name} could not build its decoders: {detail}")
        except EOFError:
            raise RuntimeError(f"{self.name} exited at start-up (exit code {self._child.wait()})") from None
        except BaseException:
            self._end_child()
            raise

    def queue_open(self, stream_id: int, cepstral_mean: str | None) -> concurrent.futures.Future:
        """Bind a stream here (any thread): its open goes with the next batch of feeds; its future
        gets the generation of the child it opened on, which its later requests name."""
        return self._queue(None, ("open", stream_id, cepstral_mean))

    def call(self, generation: int, request: tuple) -> Any:
        """One request of a stream bound to child `generation`, and its answer (blocking: on `worker`)."""
        self._check_generation(generation, self._live_child())
        op, stream_id, argument = request
        if op != "feed":
            return self._round_trip(request)
        partial = None  # the last partial that changed, as one feed of the whole would answer
        for start in range(0, max(len(argument), 1), MAX_FEED_BYTES):
            answer = self._round_trip((op, stream_id, argument[start : start + MAX_FEED_BYTES]))
            partial = partial if answer is None else answer
        return partial

    async def run(self, generation: int, request: tuple) -> Any:
        if request[0] == "feed":
            return await asyncio.wrap_future(self.queue_feed(generation, request))
        return await self.worker.run(self.call, generation, request)

    def queue_feed(self, generation: int, request: tuple) -> concurrent.futures.Future:
        """A feed for the next batch (any thread); its future gets the partial, as `call` answers it."""
        return self._queue(generation, request)

    def _queue(self, generation: int | None, request: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._feeds_lock:
            self._feeds.append((generation, request, future))
            start_batch, self._batch_queued = not self._batch_queued, True
        if start_batch:
            try:
                self.worker.submit(self.feed_batch)
            except RuntimeError as exc:  # shut down
                self.feed_batch(DecoderProcessLost(f"{self.name} is shut down: {exc}"))
        return future

    def feed_batch(self, failed: Exception | None = None) -> None:
        """Every queued feed to the child, in as few requests as MAX_BATCH_BYTES allows (blocking: on
        `worker`); each feed's future answered."""
        with self._feeds_lock:
            feeds, self._feeds, self._batch_queued = self._feeds, [], False
        self.feed_batches[len(feeds)] += 1
        # (future, its pieces' indices in `pieces`); a feed of a lost child fails at once.
        pieces: list[tuple] = []
        # (future, its pieces' indices, for an open the generation it opens on, else None)
        waiting: list[tuple[concurrent.futures.Future, range, int | None]] = []
        for generation, (op, stream_id, argument), future in feeds:
            if not future.set_running_or_notify_cancel():
                continue  # its session went away
            if failed is not None:
                future.set_exception(failed)
                continue
            try:
                dead_code = self._live_child()
                if op != "open":  # an open binds to whichever child is live now
                    self._check_generation(generation, dead_code)
            except Exception as exc:  # noqa: BLE001 -- this request's, told to its stream
                future.set_exception(exc)
                continue
            first = len(pieces)
            if op == "open":
                pieces.append((op, stream_id, argument))
            else:
                pieces += [(op, stream_id, argument[start : start + MAX_FEED_BYTES])
                           for start in range(0, max(len(argument), 1), MAX_FEED_BYTES)]
            waiting.append((future, range(first, len(pieces)), self.generation if op == "open" else None))
        answers: list = []
        try:
            while len(answers) < len(pieces):
                batch, size = [], 0
                for piece in pieces[len(answers):]:
                    audio = len(piece[2]) if piece[0] == "feed" else 0
                    if batch and size + audio > MAX_BATCH_BYTES:
                        break
                    batch.append(piece)
                    size += audio
                answers += self._round_trip(("batch", None, batch))
        except Exception as exc:  # noqa: BLE001 -- the child was lost: every feed not answered fails with it
            for future, indices, _ in waiting:
                if indices[-1] >= len(answers):
                    future.set_exception(exc)
            waiting = [entry for entry in waiting if entry[1][-1] < len(answers)]
        for future, indices, opened_on in waiting:
            partial, error = None, None  # the last partial that changed, as one feed of the whole would answer
            for result, piece_error in (answers[i] for i in indices):
                error = error or piece_error
                partial = partial if result is None else result
            if error is not None:
                future.set_exception(RuntimeError(f"pocketsphinx: {error}"))
            else:
                future.set_result(partial if opened_on is None else opened_on)

    def _check_generation(self, generation: int, dead_code: int | None) -> None:
        """Raise if the stream's child (`generation`) is not the live one; `dead_code`, the exit code
        of a child found dead just now (_live_child)."""
        if generation != self.generation:
            if dead_code is not None:  # it died since this stream's last request: this request is the first to know
                raise DecoderProcessLost(f"{self.name}'s process died (exit code {dead_code}) before this "
                                         f"request; a new one is started")
            raise DecoderProcessLost(f"{self.name}'s process was lost earlier; this stream's decoder went with it")

    def answer_deadline_s(self, request: tuple) -> float:
        """How long the child may take to answer this request (see ANSWER_FLOOR_S); keeps count of
        each stream's utterance, whose end is searched again. A batch's: one floor, and the time
        for each of its feeds' audio."""
        op, stream_id, argument = request
        if op == "batch":
            return ANSWER_FLOOR_S + sum(self.answer_deadline_s(feed) - ANSWER_FLOOR_S for feed in argument)
        if op == "feed":
            samples = len(argument) // 2
            self._utterance_samples[stream_id] = self._utterance_samples.get(stream_id, 0) + samples
        else:  # open starts a stream; finish, renew and close end its utterance
            samples = self._utterance_samples.pop(stream_id, 0)
        return ANSWER_FLOOR_S + samples / SAMPLE_RATE * ANSWER_S_PER_AUDIO_S

    def _round_trip(self, request: tuple) -> Any:
        deadline_s = self.answer_deadline_s(request)
        try:
            self._conn.send(request)
            answered = self._conn.poll(deadline_s)
            if answered:
                result, error, cpu_s, built = self._conn.recv()
        except (EOFError, OSError):
            code = self._bury("died")
            self._restart()
            raise DecoderProcessLost(f"{self.name}'s process died (exit code {code}) during this request; "
                                     f"a new one is started") from None
        if not answered:
            self._bury("hung")
            self._restart()
            raise DecoderProcessLost(f"{self.name}'s process did not answer within {deadline_s:.0f} s (hung): "
                                     f"it was killed and a new one is started")
        self.busy_s += cpu_s
        self.built += built
        self.decoders += built
        if error is not None:
            raise RuntimeError(f"pocketsphinx: {error}")
        return result

    def _live_child(self) -> int | None:
        """A child that died while idle (or one that failed to start) replaced before a request; the
        dead child's exit code when it was found dead here, else None."""
        if self._child is None:
            self._restart(quiet=False)
        elif self._child.poll() is not None:
            code = self._bury("died")
            self._restart(quiet=False)
            return code
        return None

    def _bury(self, cause: str) -> int | None:
        """The child is dead, or hung and killed here: counted by cause, its exit code; the streams
        bound to it are lost with it."""
        code = self._end_child()
        self._utterance_samples.clear()
        if not self._closing:
            self.lost[cause] += 1
            self.generation += 1
            log.error("%s's process was lost (%s, exit code %s); its streams lose their utterance in progress",
                      self.name, cause, code)
        return code

    def _restart(self, quiet: bool = True) -> None:
        """A new child; a failure to start raises only when a request waits for it (`quiet=False`),
        else it is logged and the next request tries again."""
        if self._closing:
            raise DecoderProcessLost(f"{self.name} is shut down")
        try:
            self.spawn()
            self.await_ready()
        except Exception:
            if not quiet:
                raise
            log.exception("%s: a new process could not start; the next request tries again", self.name)
        if self._closing:  # shut down while it started: it must not outlive the server's close
            self._end_child()

    def _end_child(self) -> int | None:
        child, self._child = self._child, None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if child is None:
            return None
        if child.poll() is None:
            child.kill()
        return child.wait()

    def close(self) -> None:
        """Stop the child with the server: queued requests cancelled, the child terminated."""
        self._closing = True
        self.worker.shutdown()
        self.feed_batch(DecoderProcessLost(f"{self.name} is shut down"))  # feeds whose batch call was cancelled
        child = self._child
        if child is None:
            return
        child.terminate()  # a request in flight reads EOF and fails: the server is stopping
        try:
            child.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def start_all(processes: list[DecoderProcess]) -> None:
    """Start the children side by side and wait for all (blocking: at start-up)."""
    for process in processes:
        process.spawn()
    try:
        for process in processes:
            process.await_ready()
    except BaseException:
        for process in processes:
            process.close()
        raise
