"""Continuous batching of the CosyVoice 2 LM over one pooled static KV cache.

The pool is gpt-fast's `setup_caches(max_batch, max_seq)`: one KVCache of `slots` rows, allocated at
start-up; a request (`LMRow`) holds one slot for its whole utterance and is fed by a program
(lm.py: a generator of `Step`s). Rows join and leave between steps. It is the `DecodePool`
(voicebot/serving/model_interfaces.py) the device's scheduler steps (voicebot/serving/scheduler.py):

- `decode(rows)` runs every row whose next step is one token in one batched forward (each row at its
  own position, in its own slot, masked per row), samples all of them in one call, and advances
  their programs. The host waits for the device once per step, for the B sampled tokens: positions
  and slots go over without a wait (sampling.host_to_device), sampling runs on the device;
- `prefill(row)` feeds at most `prefill_chunk` positions of a longer step, so a new request's prompt
  never holds the others' decode for more than about one step: the scheduler interleaves chunks
  with decode steps.

On CUDA, `graphs=True` runs the decode step as a CUDA graph captured per bucketed batch size
(DECODE_BUCKETS): the batch is padded to its bucket with rows that write only a scratch slot, and
attention reads a fixed `max_seq_len` keys, so the step has no host sync to break the capture.
Elsewhere the same forward runs eagerly at the exact batch size.

Thread-safety: one thread (the scheduler's) uses a pool.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from voicebot.serving.model_interfaces import PoolFull
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, PromptPrefix, Program, Step, choose, keys_to_attend, load_prefix
from voicebot.tts.cosyvoice2.sampling import Sampler, greedy, host_to_device

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)


def decode_bucket(n_rows: int, buckets: tuple[int, ...] = DECODE_BUCKETS) -> int:
    """The smallest bucket that holds n_rows (a CUDA graph is captured per bucket)."""
    i = bisect.bisect_left(buckets, n_rows)
    if n_rows < 1 or i == len(buckets):
        raise ValueError(f"{n_rows} rows: a decode batch holds 1 to {buckets[-1]}")
    return buckets[i]


@dataclass(eq=False)
class LMRow:
    """One request in the pool: its slot, its sampler, and the program now feeding it."""

    slot: int
    sampler: Sampler
    program: Program | None = None
    step: Step | None = None  # the forward it waits for; None while it has no program running
    fed: int = 0  # positions of `step` already prefilled
    emitted: list[int] = field(default_factory=list)  # tokens emitted, not yet taken
    closed: bool = False

    @property
    def waiting(self) -> int:
        """Positions of its pending step not yet fed (0: nothing to run)."""
        return 0 if self.step is None else self.step.length - self.fed

    def take(self) -> list[int]:
        tokens, self.emitted = self.emitted, []
        return tokens


class LMPool:
    def __init__(self, lm: CosyVoice2LM, slots: int, max_seq_len: int, prefill_chunk: int = 64,
                 graphs: bool = False, prepack: bool = True) -> None:
        if graphs and slots > DECODE_BUCKETS[-1]:
            raise ValueError(f"{slots} slots: CUDA graphs are captured up to batch {DECODE_BUCKETS[-1]}")
        self.lm, self.slots, self.prefill_chunk = lm, slots, prefill_chunk
        self.graphs = graphs
        # On CPU, steps of many rows (and prefill chunks) multiply prepacked weights: a second copy
        # of the linear layers' weights (1.43 GB fp32 at released size), none elsewhere.
        self.prepacked_bytes = lm.prepack() if prepack else 0
        # One slot more than requests get: the padding rows of a graph batch write there.
        self.cache = lm.new_cache(max_seq_len, batch=slots + 1)
        self.scratch = slots
        # A heap: the lowest free slot goes first, so the rows in use tend to be slots 0..B-1,
        # which attention reads as a view of the cache instead of gathering them.
        self._free = list(range(slots))
        # Per bucket: the graph's static inputs (x, pos, slots) and the captured graph with its output.
        self._static: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    @property
    def free(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def step_sizes(self, top: int) -> list[int]:
        """The batch sizes up to `top` a decode step can take a CUDA graph for (its buckets, `top`;
        powers of two beyond the buckets): what calibration times and captures."""
        return sorted({*(b for b in DECODE_BUCKETS if b < top), *(2**i for i in range(top.bit_length())), top})

    def open_idle(self, steps: int, context: int) -> LMRow:
        """A row fed `steps` throwaway one-position steps at about `context` positions in (calibration)."""
        w = self.lm.llm_decoder.weight
        x = torch.zeros(1, 1, w.shape[1], device=w.device, dtype=w.dtype)
        start = max(0, min(context, self.max_seq_len - steps - 2))
        row = self.open(greedy)
        self.start(row, (Step(x, start + i, ()) for i in range(steps)))
        return row

    def synchronize(self) -> None:
        """Wait until the device has done what it was given (timing a step)."""
        if self.lm.llm_decoder.weight.device.type == "cuda":
            torch.cuda.synchronize()

    def open(self, sampler: Sampler, prefix: PromptPrefix | None = None) -> LMRow:
        """A slot for a new request, its prompt prefix copied in when given."""
        if not self._free:
            raise PoolFull(f"all {self.slots} LM slots are in use")
        row = LMRow(heapq.heappop(self._free), sampler)
        if prefix is not None:
            load_prefix(self.cache, prefix, row.slot)
        return row

    def close(self, row: LMRow) -> None:
        """Free the row's slot (its keys stay until overwritten: every program writes before it reads)."""
        if not row.closed:
            row.closed, row.program, row.step = True, None, None
            heapq.heappush(self._free, row.slot)

    @torch.inference_mode()
    def start(self, row: LMRow, program: Program) -> None:
        """Feed `row` from `program` now (the previous one must have ended)."""
        if row.program is not None:
            raise RuntimeError("the row's previous program has not ended")
        row.program = program
        self._advance(row, None)

    @torch.inference_mode()
    def prefill(self, row: LMRow) -> None:
        """Feed the next chunk of the row's pending step; the last chunk also chooses its token."""
        step, n = row.step, min(self.prefill_chunk, row.waiting)
        device = step.x.device
        end = step.pos + row.fed + n
        pos = torch.arange(end - n, end, device=device)
        slot = host_to_device([row.slot], device)
        n_keys = keys_to_attend(end, self.max_seq_len)
        x = step.x[:, row.fed : row.fed + n]
        row.fed += n
        if row.waiting:
            self.lm.qwen(x, pos, self.cache, slot, n_keys)  # keys and values only; no token yet
        else:
            self._advance(row, choose([step], self.lm(x, pos, self.cache, slot, n_keys), [row.sampler])[0])

    @torch.inference_mode()
    def decode(self, rows: list[LMRow]) -> None:
        """One batched step of rows each waiting on a one-position step."""
        rows = sorted(rows, key=lambda row: row.slot)
        steps = [row.step for row in rows]
        if any(row.waiting != 1 for row in rows):
            raise ValueError("decode takes rows with one position left to feed; prefill the others")
        device = steps[0].x.device
        x = torch.cat([step.x[:, -1:] for step in steps])  # (B, 1, D)
        positions = [step.pos + step.length - 1 for step in steps]
        pos = host_to_device([[p] for p in positions], device)
        slots = host_to_device([row.slot for row in rows], device)
        if self.graphs:
            logp = self._graph_logp(x, pos, slots)
        else:  # rows in slots 0..B-1 are read as a view of the cache, others gathered
            compact = all(row.slot == i for i, row in enumerate(rows))
            n_keys = keys_to_attend(max(positions) + 1, self.max_seq_len)
            logp = self.lm(x, pos, self.cache, None if compact else slots, n_keys)
        # The step's one host sync: the sampled tokens' copy back (choose -> sample_rows).
        for row, token in zip(rows, choose(steps, logp, [row.sampler for row in rows])):
            row.fed += 1
            self._advance(row, token)

    def _advance(self, row: LMRow, token: int | None) -> None:
        """Send `token` (None to start) and run the program to its next Step, collecting what it emits."""
        try:
            message = next(row.program) if token is None else row.program.send(token)
            while not isinstance(message, Step):
                row.emitted.append(message)
                message = next(row.program)
        except StopIteration:
            row.program, row.step = None, None
            return
        row.step, row.fed = message, 0

    # --- CUDA graphs

    def _graph_logp(self, x: Tensor, pos: Tensor, slots: Tensor) -> Tensor:
        """The decode step padded to its bucket (pad rows: zeros at position 0 of the scratch slot),
        replayed as that bucket's CUDA graph; off CUDA (the tests) the same padded step runs eagerly."""
        n, bucket = x.shape[0], decode_bucket(x.shape[0])
        x_in, pos_in, slots_in = static = self._static_inputs(bucket)
        x_in.zero_()
        x_in[:n] = x
        pos_in.zero_()
        pos_in[:n] = pos
        slots_in.fill_(self.scratch)
        slots_in[:n] = slots
        if x.device.type != "cuda":
            return self._padded_forward(*static)[:n]
        graph, logp = self._captured(bucket, static)
        graph.replay()
        return logp[:n].clone()  # the graph overwrites its output at the next replay

    def _padded_forward(self, x: Tensor, pos: Tensor, slots: Tensor) -> Tensor:
        h = self.lm.qwen(x, pos, self.cache, slots, n_keys=self.max_seq_len)
        return self.lm.logp(h[:, -1])

    def _static_inputs(self, bucket: int) -> tuple[Tensor, Tensor, Tensor]:
        if bucket not in self._static:
            w = self.lm.llm_decoder.weight
            self._static[bucket] = (torch.zeros(bucket, 1, w.shape[1], device=w.device, dtype=w.dtype),
                                    torch.zeros(bucket, 1, dtype=torch.long, device=w.device),
                                    torch.full((bucket,), self.scratch, dtype=torch.long, device=w.device))
        return self._static[bucket]

    def _captured(self, bucket: int, static: tuple[Tensor, Tensor, Tensor]) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """The bucket's decode step captured on first use, reading `static` and writing its output."""
        if bucket not in self._graphs:
            # Warm up on a side stream before capturing, as torch.cuda.graphs requires; the static
            # inputs address only the scratch slot then.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._padded_forward(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logp = self._padded_forward(*static)
            self._graphs[bucket] = (graph, logp)
        return self._graphs[bucket]
