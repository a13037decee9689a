"""The voices' prompt state that CosyVoice 2 replies read: the Voice (features, from the library),
its LM prompt prefix (sentences mode) and its flow prompt state (Token2Wav's).

A voice's state is derived once per voice on a background thread and swapped in between the
scheduler's steps: a session's periodic reset never stalls the others. That thread is a `Worker`'s,
so a derivation that fails in any way (SystemExit included) or whose thread dies fails only that
reset: the voice keeps the state it had, and the next reset derives again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math

import torch

from voicebot.config.engines import Cosyvoice2Config
from voicebot.serving.scheduler import Scheduler
from voicebot.serving.worker import Worker
from voicebot.tts.cosyvoice2.flow import FlowCache
from voicebot.tts.cosyvoice2.lm import CosyVoice2LM, PromptPrefix, prompt_prefix
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav
from voicebot.tts.cosyvoice2.voices import Voice, VoiceLibrary

log = logging.getLogger(__name__)


def flow_prompt(voice: Voice, device: torch.device, dtype: torch.dtype) -> FlowPrompt:
    return FlowPrompt(voice.flow_prompt_speech.to(device), voice.prompt_feat.to(device, dtype),
                      voice.embedding.to(device, dtype))


class VoicePrompts:
    """Every voice's prompt state, and its refresh (the periodic reset) off the scheduler.

    `worker` derives the states, one at a time, beside the scheduler (never on it). A derivation
    makes the voice's LM prompt prefix too while replies start from it (`config.text_input`:
    sentences, read at each derivation)."""

    def __init__(self, library: VoiceLibrary, lm: CosyVoice2LM, token2wav: Token2Wav, scheduler: Scheduler,
                 worker: Worker, config: Cosyvoice2Config, device: torch.device, dtype: torch.dtype) -> None:
        self.library, self.lm, self.token2wav, self.scheduler, self.worker = library, lm, token2wav, scheduler, worker
        self.config, self.device, self.dtype = config, device, dtype
        self.refreshes_failed = 0  # resets skipped: their derivation failed, the old state kept
        # voice name -> (the Voice it was computed from, its LM prompt prefix); scheduler thread only
        self._lm_prefixes: dict[str, tuple[Voice, PromptPrefix]] = {}
        self._refreshing: dict[str, asyncio.Future[int | None]] = {}  # voice -> its refresh in flight

    def lm_prefix(self, voice: Voice) -> PromptPrefix:
        """The voice's [sos | prompt text] LM keys/values, computed once per Voice object: a
        refreshed voice (a new object) comes with its own. Scheduler thread only."""
        cached = self._lm_prefixes.get(voice.name)
        if cached is None or cached[0] is not voice:
            cached = (voice, prompt_prefix(self.lm, voice.prompt_text))
            self._lm_prefixes[voice.name] = cached
        return cached[1]

    def lm_prefix_bytes(self) -> int:
        return sum(prefix.nbytes() for _, prefix in list(self._lm_prefixes.values()))

    def warm(self, voice: Voice) -> None:
        """The flow's prompt state takes seconds on CPU: pay it now, not in the next reply."""
        self.token2wav.prompt_state(flow_prompt(voice, self.device, self.dtype))

    async def refresh(self, name: str) -> int | None:
        """Re-derive a voice's state from its source and swap it in; the bytes of the state it
        replaced, or None when the derivation failed and the voice keeps its state. Concurrent
        calls for one voice share one derivation (the later ones get 0, or None)."""
        if name in self._refreshing:
            return 0 if await asyncio.shield(self._refreshing[name]) is not None else None
        future = asyncio.get_running_loop().create_future()
        self._refreshing[name] = future
        try:
            try:
                fresh = await self.worker.run(self.derive, name)
            except Exception:  # JobAborted and WorkerThreadLost too: the worker turned them into these
                self.refreshes_failed += 1
                log.exception("cosyvoice2: deriving voice %r failed; it keeps its state until the next reset", name)
                future.set_result(None)
                return None
            freed = await self.scheduler.call(functools.partial(self._swap, *fresh), deadline=math.inf)
            future.set_result(freed)
            return freed
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: joiners may be gone
            raise
        finally:
            del self._refreshing[name]

    def derive(self, name: str) -> tuple[Voice, PromptPrefix | None, FlowCache]:
        """On the voices thread: everything a voice's replies read, computed from its source. The
        models' weights are only read, so this runs beside the scheduler's steps."""
        torch.set_num_threads(1)  # this thread's own intra-op pool: the scheduler's cores stay its
        voice = self.library.derive(name)
        prefix = prompt_prefix(self.lm, voice.prompt_text) if self.config.text_input == "sentences" else None
        return voice, prefix, self.token2wav.new_prompt_state(flow_prompt(voice, self.device, self.dtype))

    def _swap(self, voice: Voice, prefix: PromptPrefix | None, flow_state: FlowCache) -> int:
        """On the scheduler thread, between steps: the derived state replaces the old at once."""
        old = self.library[voice.name]
        freed = old.nbytes()
        self.library.put(voice)
        stale_prefix = self._lm_prefixes.pop(voice.name, None)
        if stale_prefix is not None:
            freed += stale_prefix[1].nbytes()
        if prefix is not None:
            self._lm_prefixes[voice.name] = (voice, prefix)
        prompt = flow_prompt(voice, self.device, self.dtype)
        freed += self.token2wav.prompt_state_bytes().get(prompt.key(), 0)
        self.token2wav.put_prompt_state(prompt, flow_state)
        return freed
