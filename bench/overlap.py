"""LM decoding beside flow + HiFT: one utterance's two halves on two threads, sharing the cores.

A decode step streams the LM's weights once per token (memory bound); a flow chunk is GEMMs
(compute bound). Run one after the other, each takes both cores in turn and the audio waits for
the sum. Here the LM decodes on a background thread while the calling thread renders the chunks
that the tokens complete, each with its own share of torch's intra-op threads (set per thread), so
the machine runs as many busy threads as it has cores. The official code instead runs a 2-thread LM
beside a 2-thread flow on 2 cores, which doubles its first chunk's time (baseline spec).

Until the first chunk is out, the two run one after the other with every thread each: the first
audio waits for both anyway, and on two cores splitting them made it later (bench/cosyvoice2.py).
Once the LM has finished, the rendering thread takes all the threads back for what remains (the
final chunk, which in `exact` mode re-runs the whole utterance).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

import _repo  # noqa: F401  (this checkout's root on sys.path: bench/__init__.py)
from voicebot.tts.cosyvoice2.token2wav_stream import Token2WavStream

_END = object()


def overlapped(tokens: Iterable[int], stream: Token2WavStream, lm_threads: int = 1,
               render_threads: int | None = None) -> Iterator[Tensor]:
    """Yield `stream`'s audio chunks; after the first, `tokens` (e.g. lm.generate) is consumed on another thread.

    render_threads defaults to what remains of torch's thread count after lm_threads (at least 1).
    The token iterator must not share a torch.Generator with the stream's vocoder noise: the two
    draw concurrently. Closing this generator early stops the decoding after its current token.
    """
    tokens = iter(tokens)
    for token in tokens:
        first = stream.push([token])
        if first:
            yield from first
            break
    else:
        yield stream.finish()
        return
    total = torch.get_num_threads()
    render_threads = render_threads or max(1, total - lm_threads)
    found: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def decode() -> None:
        torch.set_num_threads(lm_threads)
        try:
            for token in tokens:
                found.put(token)
                if stop.is_set():
                    return
        except BaseException as exc:  # handed to the consumer, which re-raises it
            found.put(exc)
        found.put(_END)

    worker = threading.Thread(target=decode, name="cosyvoice2-lm", daemon=True)
    torch.set_num_threads(render_threads)
    worker.start()
    try:
        while True:
            batch = [found.get()]
            while not found.empty():  # take every token decoded meanwhile: fewer, larger pushes
                batch.append(found.get())
            ended = batch[-1] is _END
            if ended:
                batch.pop()
            for item in batch:
                if isinstance(item, BaseException):
                    raise item
            if ended:
                torch.set_num_threads(total)  # the LM is done: all cores for the rest
            yield from stream.push(batch)
            if ended:
                yield stream.finish()
                return
    finally:
        stop.set()
        worker.join()
        torch.set_num_threads(total)
