"""CosyVoice 2 as the server's Synthesizer: reply text deltas in, 24 kHz audio chunks out.

Text is cut into sentences as it arrives (SentenceSegmenter); each sentence is normalised and, if
long, split into utterances (frontend), and each utterance is one official unistream request: the
LM decodes speech tokens into the session's KV cache while Token2WavStream renders them chunk by
chunk. All model work runs on one Worker thread per device in small steps (a few LM tokens, and at
most the flow/HiFT chunk they complete), so concurrent sessions interleave and a cancelled reply
stops after the step in flight. One thread also serialises every use of a session's KV cache: a
new reply's first step always runs after the cancelled reply's last one.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import AsyncIterator, Iterator

import numpy as np
import torch

from voicebot.config import Cosyvoice2Config
from voicebot.engine import EngineInfo, ResetReport
from voicebot.serving.worker import Worker
from voicebot.tts.base import SentenceSynthesisContext, SpeechChunk, Synthesizer, VoiceInfo
from voicebot.tts.cosyvoice2.frontend import Frontend
from voicebot.tts.cosyvoice2.lm import KVCache, PromptPrefix, generate, prompt_prefix
from voicebot.tts.cosyvoice2.loader import load_cosyvoice2, resolve_device, resolve_dtype, resolve_model_dir
from voicebot.tts.cosyvoice2.quant import quantize_lm
from voicebot.tts.cosyvoice2.sampling import RasSampler
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav, Token2WavStream
from voicebot.tts.cosyvoice2.voices import Voice, VoiceLibrary

log = logging.getLogger(__name__)

CONFIG_KEY = "tts.cosyvoice2.model"


# --- kernels

# Every attention of the LM and the flow is torch's scaled_dot_product_attention, which on CUDA
# dispatches to its own flash or memory-efficient kernel. The flash-attn package is never called,
# so it is not reported even when it is installed.
ATTENTION = "sdpa"


# --- the shared engine


class CosyVoice2Synthesizer(Synthesizer):
    name = "cosyvoice2"

    def __init__(self, config: Cosyvoice2Config, default_voice: str) -> None:
        self.config = config
        self.default_voice = default_voice
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.worker = Worker(f"cosyvoice2-{self.device}", threads=1)
        self.library: VoiceLibrary | None = None
        self.contexts: set[CosyVoice2Context] = set()
        self.model_dir: Path | None = None
        # voice name -> (the Voice it was computed from, its LM prompt prefix); worker thread only
        self._lm_prefixes: dict[str, tuple[Voice, PromptPrefix]] = {}

    def load(self) -> None:
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.model_dir = resolve_model_dir(self.config.model, self.config.model_cache, CONFIG_KEY)
        modules = load_cosyvoice2(self.model_dir, self.device, self.dtype)
        self.hparams, self.lm = modules.hparams, modules.lm
        if self.config.lm_int8:  # after the strict checkpoint load: the wrappers change the module tree
            quantize_lm(self.lm)
        self.token2wav = Token2Wav(modules.flow, modules.hift, mode=self.config.stream_mode,
                                   max_prompt_states=self.config.flow_prompt_states)
        library = VoiceLibrary(Frontend.from_model_dir(self.model_dir, cuda=self.device.type == "cuda"),
                               self.config.voice_cache_dir)
        if (self.model_dir / "spk2info.pt").is_file():
            library.load_spk2info(self.model_dir / "spk2info.pt")
        if self.config.voices_dir and Path(self.config.voices_dir).is_dir():
            library.load_dir(self.config.voices_dir)
        if self.default_voice not in library:
            raise ValueError(f"tts.voice {self.default_voice!r} is not a CosyVoice 2 voice; have {library.names()}")
        self.library = library
        self._warm_flow_prompt_state(library[self.default_voice])
        log.info("cosyvoice2 loaded from %s on %s/%s, %d voices", self.model_dir, self.device, self.dtype,
                 len(library.names()))

    def voices(self) -> list[VoiceInfo]:
        return self.library.list() if self.library else []

    def open(self, voice: str | None = None) -> CosyVoice2Context:
        context = CosyVoice2Context(self, self._check_voice(voice or self.default_voice))
        self.contexts.add(context)
        return context

    def info(self) -> EngineInfo:
        loaded = self.library is not None
        details = {"dtype": str(self.dtype).removeprefix("torch."), "attention": ATTENTION,
                   "lm_int8": self.config.lm_int8, "kv_cache_tokens": self.config.kv_cache_tokens,
                   "sessions": len(self.contexts), "pending_steps": self.worker.pending}
        if loaded:
            details |= {"model_dir": str(self.model_dir), "voices": self.library.names(),
                        "stream_mode": self.token2wav.mode, "voice_state_bytes": self.library.nbytes(),
                        "flow_prompt_state_bytes": sum(self.token2wav.prompt_state_bytes().values()),
                        "lm_prefix_bytes": sum(prefix.nbytes() for _, prefix in list(self._lm_prefixes.values()))}
        return EngineInfo("tts", self.name, str(self.device), loaded, details)

    def close(self) -> None:
        self.worker.shutdown()

    def _check_voice(self, voice: str) -> str:
        if self.library is None or voice not in self.library:
            raise KeyError(voice)
        return voice

    def new_cache(self) -> KVCache:
        return self.lm.new_cache(self.config.kv_cache_tokens)

    def lm_prefix(self, voice: Voice) -> PromptPrefix:
        """The voice's [sos | prompt text] LM keys/values, computed once per Voice object: a
        refreshed voice (a new object) gets a new prefix, never the old one's."""
        cached = self._lm_prefixes.get(voice.name)
        if cached is None or cached[0] is not voice:
            cached = (voice, prompt_prefix(self.lm, voice.prompt_text))
            self._lm_prefixes[voice.name] = cached
        return cached[1]

    def rederive_voice(self, name: str) -> Voice:
        """Drop everything cached for a voice and rebuild it from its source (the periodic reset):
        its features, its LM prompt prefix and its flow prompt state. Worker thread only."""
        stale = flow_prompt(self.library[name], self.device, self.dtype)
        voice = self.library.refresh(name)
        self.lm_prefix(voice)  # a new Voice object, so a new prefix
        # Token2Wav keys prompt states by content, which a refresh from an unchanged source keeps,
        # so the entry must go or it would be found again.
        self.token2wav.evict_prompt_state(stale)
        self._warm_flow_prompt_state(voice)
        return voice

    def _warm_flow_prompt_state(self, voice: Voice) -> None:
        if self.token2wav.mode != "recompute":
            # The flow's prompt state takes seconds on CPU: pay it now, not in the next reply.
            self.token2wav.prompt_state(flow_prompt(voice, self.device, self.dtype))


# --- one session


def flow_prompt(voice: Voice, device: torch.device, dtype: torch.dtype) -> FlowPrompt:
    return FlowPrompt(voice.flow_prompt_speech.to(device), voice.prompt_feat.to(device, dtype),
                      voice.embedding.to(device, dtype))


class _Utterance:
    """One utterance's blocking work, advanced by `step()` calls on the worker thread."""

    def __init__(self, engine: CosyVoice2Synthesizer, cache: KVCache, voice: Voice, text_ids: list[int],
                 generator: torch.Generator, prefix: PromptPrefix | None = None) -> None:
        """prefix: the voice's LM prompt prefix (CosyVoice2Synthesizer.lm_prefix); None prefills it too."""
        dev, dtype = engine.device, engine.dtype
        sampler = RasSampler.from_hparams(engine.hparams["llm"]["sampling"], generator)
        self.tokens: Iterator[int] = generate(engine.lm, cache, sampler, text_ids, voice.prompt_text.to(dev),
                                              voice.lm_prompt_speech.to(dev), prefix=prefix)
        self.stream: Token2WavStream = engine.token2wav.stream(flow_prompt(voice, dev, dtype), generator=generator)
        self.per_step = engine.config.lm_tokens_per_step

    def step(self) -> tuple[list[np.ndarray], bool]:
        """Decode a few tokens and render whatever chunk they complete; True once the audio is all out."""
        # Never decode past the next chunk's last token: its audio goes out in this very step.
        n = max(1, min(self.per_step, self.stream.tokens_for_next_chunk - len(self.stream.tokens)))
        new = list(itertools.islice(self.tokens, n))
        chunks = self.stream.push(new)
        done = len(new) < n
        if done:
            chunks.append(self.stream.finish())
        return [c.reshape(-1).float().cpu().numpy() for c in chunks if c.numel()], done


class CosyVoice2Context(SentenceSynthesisContext):
    def __init__(self, engine: CosyVoice2Synthesizer, voice: str) -> None:
        self.engine = engine
        self.voice = voice
        self.generation = 0
        # Allocated on first use, on the worker: opening a session is cheap and never blocks the loop.
        self.cache: KVCache | None = None
        self.generator = torch.Generator(engine.device)
        self.generator.seed()

    def set_voice(self, voice: str) -> None:
        self.voice = self.engine._check_voice(voice)

    async def speak(self, sentence: str, segment: int) -> AsyncIterator[SpeechChunk]:
        engine = self.engine
        text_frontend = engine.library.frontend.text
        voice = engine.library[self.voice]
        for utterance in text_frontend.split(sentence):
            job = await engine.worker.run(self._start, voice, text_frontend.encode(utterance))
            done = False
            while not done:
                # A cancelled consumer stops here: the step in flight finishes, no further one is queued.
                audio, done = await engine.worker.run(job.step)
                for piece in audio:
                    yield SpeechChunk(piece, sentence, segment)

    def _start(self, voice: Voice, text_ids: list[int]) -> _Utterance:
        if self.cache is None:
            self.cache = self.engine.new_cache()
        return _Utterance(self.engine, self.cache, voice, text_ids, self.generator, self.engine.lm_prefix(voice))

    def state_bytes(self) -> int:
        return self.cache.nbytes() if self.cache is not None else 0

    async def reset(self) -> ResetReport:
        engine = self.engine
        freed = self.state_bytes()
        self.cache = None
        self.cache = await engine.worker.run(engine.new_cache)
        # The voice's prompt state is shared, so a reset re-derives it for every session using it.
        await engine.worker.run(engine.rederive_voice, self.voice)
        self.generation += 1
        return ResetReport(engine.name, self.generation, freed)

    async def close(self) -> None:
        self.cache = None
        self.engine.contexts.discard(self)
