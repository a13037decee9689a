"""CUDA graphs of a render's static-shape work, one per bucket, all captured at start-up (issue 24).

A `BucketGraphs` holds a function whose tensors' shapes depend only on a bucket (a tuple of ints:
rows, frames), the static inputs of each bucket, and each bucket's captured graph. `capture`
runs the function twice on a side stream (as torch.cuda.graphs requires before a capture) and
captures it; `run` copies a call's inputs (already padded to the bucket) into the static ones,
replays, and returns the graph's outputs, valid until the next replay: the caller copies what it
keeps (the rows of its own streams). Every bucket of every BucketGraphs of a model captures into one
memory pool: its graphs replay one at a time, on one stream, and each one's outputs are copied out
before the next replays.

Off CUDA there is nothing to capture: `run` calls the function on the inputs, so the padded
shapes a graph keeps are run (and tested) on CPU too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

Bucket = tuple[int, ...]


def bucket_of(n: int, buckets: Iterable[int]) -> int:
    """The smallest bucket that holds n."""
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {max(buckets)}")


class BucketGraphs:
    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], zeros: Callable[[Bucket], tuple[Tensor, ...]],
                 pool: tuple | None = None) -> None:
        """fn(*inputs) -> outputs, shapes by bucket only and no read back to the host; zeros(bucket):
        inputs of the bucket's shapes that fn may run on (the capture's)."""
        self.fn, self.zeros, self.pool = fn, zeros, pool
        self._graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], tuple[Tensor, ...]]] = {}

    @property
    def captured(self) -> list[Bucket]:
        return sorted(self._graphs)

    def capture(self, bucket: Bucket) -> None:
        static = self.zeros(bucket)
        if static[0].device.type != "cuda":
            raise ValueError("CUDA graphs need CUDA tensors")
        side = torch.cuda.Stream(static[0].device)
        side.wait_stream(torch.cuda.current_stream(static[0].device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                self.fn(*static)
        torch.cuda.current_stream(static[0].device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            outputs = self.fn(*static)
        self._graphs[bucket] = (graph, static, outputs)

    def run(self, bucket: Bucket, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """fn(*inputs), replayed as the bucket's graph (a bucket without one on CUDA is an error:
        every bucket is captured at start-up, none mid-traffic). The outputs are the graph's own,
        overwritten by the next replay of any bucket: copy what you keep."""
        if inputs[0].device.type != "cuda":
            return self.fn(*inputs)
        if bucket not in self._graphs:
            raise KeyError(f"no CUDA graph captured for bucket {bucket}; captured: {self.captured}")
        graph, static, outputs = self._graphs[bucket]
        for s, x in zip(static, inputs, strict=True):
            s.copy_(x)
        graph.replay()
        return outputs
