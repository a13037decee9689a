"""One loaded FunASR Paraformer: safe loading, per-token confidence, and its own worker thread.

Loading refuses what funasr 1.4.16 would accept silently: a checkpoint whose keys or shapes do
not match config.yaml (funasr prints a warning and serves random layers). It always passes
`disable_update=True` (otherwise every load makes an HTTP request to PyPI with no timeout) and a
local directory (so the hub is never contacted).

`AutoModel.generate` is not thread-safe, even with separate caches, so every call for a model
goes through that model's single-thread `Worker`; sessions share the model and keep their own
caches. Methods named `*_blocking` run on that thread only.

The streaming model runs one session's chunk per call: funasr 1.4.16's streaming Paraformer does
not take a batch with per-row caches, so the sessions' chunks cannot share one call (issue 10).
`ParaformerStreaming.inference` asserts one input ("batch_size must be set 1") and keeps one cache
dict per call: one `encoder.start_idx` (the positional encoding's offset, the same for every row),
one `tail_chunk` and `is_final` (sessions end utterances at different chunks); `init_cache` builds
every tensor at batch 1; `WavFrontendOnline.forward` asserts batch 1; `CifPredictorV2.forward_chunk`
writes the rows' carried-over alphas and hidden state as (1, B) and (1, B, H), the rows on the time
axis, so a batch's next chunk fails (tests/serving/test_paraformer_batch.py); and `generate_chunk`
returns the tokens of all rows in one flat list. Batching it means writing that streaming loop
again around funasr's encoder, predictor and decoder modules.

Confidence comes from the decoder: Paraformer's decoder returns log-softmax posteriors and the
emitted token is their argmax, so exp(max) is the posterior of each emitted token. We wrap the
decoder call of the model instance and collect those values; nothing is approximated.
"""

from __future__ import annotations

import gc
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from voicebot.memory import release_freed_memory
from voicebot.serving.worker import Worker

log = logging.getLogger(__name__)

STREAMING_CLASS = "ParaformerStreaming"
OFFLINE_CLASS = "Paraformer"
# Tokens funasr drops from the text (generate_chunk and sentence_postprocess): they get no
# confidence either, so confidences and emitted tokens stay one to one.
_UNSPOKEN = ("<blank>", "<s>", "</s>", "<unk>", "<OOV>")
# Key under which the hook leaves a call's token confidences in the stream's own cache dict
# (funasr's init_cache at is_final rewrites only its own keys); each call takes them out.
_CONF_KEY = "voicebot_token_confidences"


class CheckpointMismatch(RuntimeError):
    """model.pt does not fit the architecture in config.yaml."""


@dataclass
class Decoded:
    text: str
    token_confidences: list[float] = field(default_factory=list)


def state_bytes(obj: object) -> int:
    """Approximate bytes held by a (nested) funasr cache: tensor data plus Python containers.

    Containers count too, so a list that grows by one small record per utterance shows up.
    """
    nbytes = getattr(obj, "nbytes", None)  # torch.Tensor, np.ndarray
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(obj, dict):
        return sys.getsizeof(obj) + sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sys.getsizeof(obj) + sum(state_bytes(v) for v in obj)
    if hasattr(obj, "__dict__"):  # funasr's state objects (VAD statistics, window detector)
        return state_bytes(vars(obj))
    return sys.getsizeof(obj)


def utterance_confidence(token_confidences: list[float]) -> tuple[float | None, float | None]:
    """(geometric mean, minimum) of the token posteriors; (None, None) when nothing was emitted.

    The geometric mean is the length-normalised posterior of the whole token sequence.
    """
    if not token_confidences:
        return None, None
    mean_log = sum(math.log(max(p, 1e-12)) for p in token_confidences) / len(token_confidences)
    return math.exp(mean_log), min(token_confidences)


def verify_checkpoint(model: Any, checkpoint: Path) -> None:
    """Raise CheckpointMismatch unless every parameter of `model` is in `checkpoint` with its shape."""
    import torch

    try:  # mmap: checking an 880 MB checkpoint should not hold another copy of it in memory
        state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # checkpoints in torch's legacy (non-zip) format cannot be mapped
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    for wrapper in ("state_dict", "model_state_dict", "model"):  # the layouts funasr accepts
        if isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    state = {k.removeprefix("module."): v for k, v in state.items()}
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape))
    if missing or wrong:
        sample = ", ".join((missing + wrong)[:5])
        raise CheckpointMismatch(
            f"{checkpoint} does not match its config.yaml: {len(missing)} missing and {len(wrong)} "
            f"mis-shaped tensors (e.g. {sample}). Is it the right model directory?"
        )


def _patch_positional_encoding() -> None:
    """Make the streaming encoder's positional encoding O(chunk) instead of O(stream position).

    funasr 1.4.16 recomputes the encoding of every position since the stream began and slices
    off the last chunk, so a chunk costs 7 ms at the start of a stream and 385 ms an hour in.
    We flush at every endpoint anyway; this keeps a long utterance from slowing every session.
    Output is identical (same positions, same formula).
    """
    import torch
    from funasr.models.transformer.embedding import StreamSinusoidalPositionEncoder

    if getattr(StreamSinusoidalPositionEncoder, "_voicebot_patched", False):
        return

    def forward(self, x, cache=None):
        _, steps, dim = x.size()
        start = 0
        if cache is not None:
            start = cache["start_idx"]
            cache["start_idx"] += steps
        positions = torch.arange(start + 1, start + steps + 1)[None, :]
        return x + self.encode(positions, dim, x.dtype).to(x.device)

    StreamSinusoidalPositionEncoder.forward = forward
    StreamSinusoidalPositionEncoder._voicebot_patched = True


def load_automodel(path: Path, device: str, threads: int) -> Any:
    """Blocking: a funasr AutoModel from a local directory, its checkpoint verified."""
    import torch
    from funasr import AutoModel

    torch.set_num_threads(threads)
    auto = AutoModel(
        model=str(path),
        device=device,
        ncpu=threads,
        disable_update=True,
        disable_pbar=True,
        disable_log=True,
        # funasr's frontends dither at inference by default: noise in, different output out.
        frontend_conf={"dither": 0.0},
    )
    verify_checkpoint(auto.model, Path(auto.kwargs["init_param"]))
    # funasr's loader keeps transient copies of the state dict: hand that memory back now.
    gc.collect()
    release_freed_memory()
    return auto


class FunasrModel:
    """A Paraformer (streaming or offline class) loaded from a local directory."""

    def __init__(
        self, name: str, path: Path, device: str = "cpu", threads: int = 1, stream_options: dict | None = None
    ) -> None:
        self.name = name
        self.path = Path(path)
        self.device = device
        self.threads = threads
        # chunk_size and look-backs for the streaming class; funasr's defaults (look-back 0) differ.
        self.stream_options = stream_options or {}
        self.worker = Worker(name, threads=1)
        self.streaming = False
        self._auto: Any = None
        self._offline_confidences: list[float] = []

    def load(self) -> None:
        """Blocking: build the model, verify its checkpoint, attach the confidence hook."""
        auto = load_automodel(self.path, self.device, self.threads)
        kind = type(auto.model).__name__
        if kind not in (STREAMING_CLASS, OFFLINE_CLASS):
            raise ValueError(f"{self.path}: model class {kind} is not supported (need {STREAMING_CLASS} or {OFFLINE_CLASS})")
        self.streaming = kind == STREAMING_CLASS
        if self.streaming:
            _patch_positional_encoding()
        self._auto = auto
        self._attach_confidence_hook()
        log.info("loaded %s (%s) from %s", self.name, kind, self.path)

    @property
    def class_name(self) -> str:
        return type(self._auto.model).__name__

    def _attach_confidence_hook(self) -> None:
        model = self._auto.model
        token_list = self._auto.kwargs.get("token_list") or []
        skip = {model.blank_id, model.sos, model.eos} | {i for i, t in enumerate(token_list) if t in _UNSPOKEN}

        def emitted(logp, lens) -> list[float]:
            best, ids = logp[0, : int(lens[0])].max(-1)
            return [math.exp(v) for i, v in zip(ids.tolist(), best.tolist()) if i not in skip]

        if self.streaming:
            original = model.cal_decoder_with_predictor_chunk

            def streaming_hook(enc, enc_lens, embeds, ys_lens, cache=None):
                logp, lens = original(enc, enc_lens, embeds, ys_lens, cache=cache)
                cache.setdefault(_CONF_KEY, []).extend(emitted(logp, lens))
                return logp, lens

            # The confidences live in the stream's own cache: per session, by construction.
            model.cal_decoder_with_predictor_chunk = streaming_hook
        else:
            original_offline = model.cal_decoder_with_predictor

            def offline_hook(enc, enc_lens, embeds, ys_lens):
                logp, lens = original_offline(enc, enc_lens, embeds, ys_lens)
                # Only this model's worker thread calls it, one utterance at a time.
                self._offline_confidences.extend(emitted(logp, lens))
                return logp, lens

            model.cal_decoder_with_predictor = offline_hook

    # -- calls below run on self.worker's thread --------------------------------------------------

    def stream_blocking(self, cache: dict, audio: np.ndarray, is_final: bool) -> Decoded:
        """Feed one piece of a stream; returns the newly emitted text and its token confidences.

        At `is_final` funasr flushes the tail and re-initialises `cache` in place.
        """
        result = self._auto.generate(input=audio, cache=cache, is_final=is_final, key="stream", **self.stream_options)
        return Decoded(result[0]["text"] if result else "", cache.pop(_CONF_KEY, []))

    def decode_blocking(self, audio: np.ndarray) -> Decoded:
        """Decode one whole utterance."""
        if self.streaming:
            # A streaming model decodes a whole utterance as one final chunk on a fresh cache.
            return self.stream_blocking({}, audio, True)
        self._offline_confidences.clear()
        result = self._auto.generate(input=audio, key="utterance")
        return Decoded(result[0]["text"] if result else "", list(self._offline_confidences))

    # -- async entry points -------------------------------------------------------------------

    async def stream(self, cache: dict, audio: np.ndarray, is_final: bool) -> Decoded:
        return await self.worker.run(self.stream_blocking, cache, audio, is_final)

    async def decode(self, audio: np.ndarray) -> Decoded:
        return await self.worker.run(self.decode_blocking, audio)

    def close(self) -> None:
        self.worker.shutdown()
        self._auto = None
