"""CosyVoice 2 as the server's Synthesizer: reply text deltas in, 24 kHz audio chunks out.

Text is cut into sentences as it arrives (SentenceSegmenter) and each sentence is normalised. With
`text_input: bistream` (the default) the sentences of a reply are pushed one by one into an LM
request that mixes text and speech tokens (official inference_bistream), a new request every
60-odd text tokens; with `text_input: sentences` each sentence, split into utterances if long, is
one official unistream request, which starts from the voice's cached LM prompt prefix. Either way
the LM decodes speech tokens into the session's KV cache while Token2WavStream renders them chunk
by chunk. All model work runs on one Worker thread per device in small steps (a few LM tokens, and at
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
from voicebot.engine_reports import EngineInfo, ResetReport
from voicebot.serving.worker import Worker
from voicebot.tts.base import SentenceSynthesisContext, SpeechChunk, Synthesizer, VoiceInfo
from voicebot.tts.segmenter import sentences
from voicebot.tts.cosyvoice2.bistream import Bistream
from voicebot.tts.cosyvoice2.frontend import Frontend, language, only_punctuation
from voicebot.tts.cosyvoice2.lm import KVCache, PromptPrefix, generate, prompt_prefix
from voicebot.tts.cosyvoice2.loader import load_cosyvoice2, resolve_device, resolve_dtype, resolve_model_dir
from voicebot.tts.cosyvoice2.quant import quantize_lm
from voicebot.tts.cosyvoice2.sampling import RasSampler
from voicebot.tts.cosyvoice2.token2wav import FlowPrompt, Token2Wav, Token2WavStream
from voicebot.tts.cosyvoice2.voices import Voice, VoiceLibrary

log = logging.getLogger(__name__)

CONFIG_KEY = "tts.cosyvoice2.model"


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
        kind = CosyVoice2BistreamContext if self.config.text_input == "bistream" else CosyVoice2Context
        context = kind(self, self._check_voice(voice or self.default_voice))
        self.contexts.add(context)
        return context

    def info(self) -> EngineInfo:
        loaded = self.library is not None
        # The LM's attention kernel; the flow's is always SDPA (its chunk masks are not causal).
        details = {"dtype": str(self.dtype).removeprefix("torch."), "attention": self.lm.attention if loaded else None,
                   "lm_int8": self.config.lm_int8, "text_input": self.config.text_input, "kv_cache_tokens": self.config.kv_cache_tokens,
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
        its features, its LM prompt prefix (sentences mode) and its flow prompt state. Worker thread only."""
        stale = flow_prompt(self.library[name], self.device, self.dtype)
        voice = self.library.refresh(name)
        if self.config.text_input == "sentences":  # the only mode that starts from the LM prefix
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
    """One utterance's blocking work on the worker thread: speech tokens drawn a few at a time from
    `tokens` (an LM generator), each flow/HiFT chunk rendered as soon as its tokens exist."""

    def __init__(self, stream: Token2WavStream, per_step: int, tokens: Iterator[int] = iter(())) -> None:
        self.stream = stream
        self.per_step = per_step
        self.tokens = tokens

    def step(self) -> tuple[list[np.ndarray], bool]:
        """Decode a few tokens and render whatever chunk they complete; True once `tokens` is exhausted."""
        # Never decode past the next chunk's last token: its audio goes out in this very step.
        n = max(1, min(self.per_step, self.stream.tokens_for_next_chunk - len(self.stream.tokens)))
        new = list(itertools.islice(self.tokens, n))
        return _numpy(self.stream.push(new)), len(new) < n

    def finish(self) -> list[np.ndarray]:
        """The utterance's last chunk: call once its tokens are all decoded."""
        return _numpy([self.stream.finish()])


def _numpy(chunks: list[torch.Tensor]) -> list[np.ndarray]:
    return [c.reshape(-1).float().cpu().numpy() for c in chunks if c.numel()]


class _BistreamUtterance(_Utterance):
    """An utterance whose text arrives sentence by sentence (official inference_bistream): each
    sentence is pushed into the LM as it comes, and the LM decodes what that text unlocks."""

    def __init__(self, engine: CosyVoice2Synthesizer, cache: KVCache, voice: Voice, generator: torch.Generator) -> None:
        dev, dtype = engine.device, engine.dtype
        sampler = RasSampler.from_hparams(engine.hparams["llm"]["sampling"], generator)
        self.lm = Bistream(engine.lm, cache, sampler, voice.prompt_text.to(dev), voice.lm_prompt_speech.to(dev))
        super().__init__(engine.token2wav.stream(flow_prompt(voice, dev, dtype), generator=generator),
                         engine.config.lm_tokens_per_step)
        self.frontend = engine.library.frontend.text
        self.text = ""  # the sentences it voices so far

    @property
    def full(self) -> bool:
        """Start the next sentence in a new utterance: this one has the official utterance length
        (token_min_n text tokens), or has used half its KV cache."""
        return (self.lm.n_text >= self.frontend.token_min_n
                or 2 * self.lm.pos > self.lm.cache.max_seq_len)

    def push_text(self, sentence: str) -> None:
        # The space the sentence split removed: "Hi." + " How" tokenizes as the whole text would.
        joiner = " " if self.text and language(sentence) == "en" else ""
        self.text += joiner + sentence  # as written: what the pacer reports as heard
        self.tokens = self.lm.push(self.frontend.encode(joiner + self.frontend.normalize(sentence)))

    def end_text(self) -> None:
        self.tokens = self.lm.finish()

    def finish(self) -> list[np.ndarray]:
        if self.lm.truncated:
            log.warning("cosyvoice2: utterance cut at the LM's length limit or KV cache end (%d positions): %r",
                        self.lm.pos, self.text)
        return super().finish()


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
            async for piece in self._render(job, finish=True):
                yield SpeechChunk(piece, sentence, segment)

    async def _render(self, job: _Utterance, finish: bool) -> AsyncIterator[np.ndarray]:
        """Step `job` until its tokens run out (then render its last chunk if `finish`). A cancelled
        consumer stops here: the step in flight finishes, no further one is queued."""
        exhausted = False
        while not exhausted:
            audio, exhausted = await self.engine.worker.run(job.step)
            for piece in audio:
                yield piece
        if finish:
            for piece in await self.engine.worker.run(job.finish):
                yield piece

    def _cache(self) -> KVCache:
        if self.cache is None:
            self.cache = self.engine.new_cache()
        return self.cache

    def _start(self, voice: Voice, text_ids: list[int]) -> _Utterance:
        engine = self.engine
        dev = engine.device
        sampler = RasSampler.from_hparams(engine.hparams["llm"]["sampling"], self.generator)
        tokens = generate(engine.lm, self._cache(), sampler, text_ids, voice.prompt_text.to(dev),
                          voice.lm_prompt_speech.to(dev), prefix=engine.lm_prefix(voice))
        stream = engine.token2wav.stream(flow_prompt(voice, dev, engine.dtype), generator=self.generator)
        return _Utterance(stream, engine.config.lm_tokens_per_step, tokens)

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


class CosyVoice2BistreamContext(CosyVoice2Context):
    """Reply text streamed into the LM as it arrives (official inference_bistream, spec §6.4).

    Complete sentences are pushed into one LM request, which decodes whatever the text so far
    unlocks; a new request starts at a sentence boundary once the current one is `full`. The
    chunks of one request form one segment whose text grows with it: where inside it the audio
    is, sentence by sentence, is not known, so an interruption's heard text is a proportion of it.
    """

    async def stream(self, text: AsyncIterator[str]) -> AsyncIterator[SpeechChunk]:
        engine = self.engine
        voice = engine.library[self.voice]
        job: _BistreamUtterance | None = None
        segment = -1
        async for sentence in sentences(text):
            if only_punctuation(sentence):
                continue
            if job is not None and job.full:
                async for chunk in self._end(job, segment):
                    yield chunk
                job = None
            if job is None:
                job = await engine.worker.run(self._start_bistream, voice)
                segment += 1
            await engine.worker.run(job.push_text, sentence)
            async for piece in self._render(job, finish=False):
                yield SpeechChunk(piece, job.text, segment)
        if job is not None:
            async for chunk in self._end(job, segment):
                yield chunk

    async def _end(self, job: _BistreamUtterance, segment: int) -> AsyncIterator[SpeechChunk]:
        await self.engine.worker.run(job.end_text)
        async for piece in self._render(job, finish=True):
            yield SpeechChunk(piece, job.text, segment)

    def _start_bistream(self, voice: Voice) -> _BistreamUtterance:
        return _BistreamUtterance(self.engine, self._cache(), voice, self.generator)
