"""CosyVoice 2 as the server's Synthesizer: reply text deltas in, 24 kHz audio chunks out.

Text is cut into sentences as it arrives (SentenceSegmenter) and normalised. With `text_input:
bistream` (the default) a reply is pushed a word at a time (`WordFeed`) into an LM request that
mixes text and speech tokens (official inference_bistream), a new request at a sentence end every
60-odd text tokens; with `text_input: sentences` each sentence, split into utterances if long, is
one official unistream request, which starts from the voice's cached LM prompt prefix.

All model work runs on the device's `Scheduler` thread (voicebot/serving/scheduler.py): each
utterance holds a slot of the pooled LM cache for its life, the decode steps of every speaking
session run as one batch, and the flow/HiFT chunks their tokens complete run earliest deadline
first, the chunks of several sessions in one flow call and one HiFT call (Token2Wav.render). Each
utterance is a `SpeechJob` (speech_job.py: the step loop); a bistream reply's text goes in through
bistream_text.py. The voices' prompt state, and its refresh off the scheduler at a session's reset,
is voice_prompts.py's.

This module: the engine (loading, the render call, admission, the sessions it has open) and each
session's context, which turns a reply's text into utterances.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from collections import deque
from pathlib import Path
from typing import AsyncIterator

import numpy as np
import torch

from voicebot.config.engines import Cosyvoice2Config
from voicebot.engine_reports import EngineInfo, ResetReport
from voicebot.metrics import register_voice_refreshes
from voicebot.serving.metrics import register_scheduler_metrics
from voicebot.serving.model_interfaces import Rendering
from voicebot.serving.scheduler import Scheduler
from voicebot.serving.worker import Worker
from voicebot.tts.base import SAMPLE_RATE, SentenceSynthesisContext, SpeechChunk, Synthesizer, VoiceInfo
from voicebot.tts.cosyvoice2.bistream import Bistream
from voicebot.tts.cosyvoice2.bistream_text import BistreamText, WordFeed
from voicebot.tts.cosyvoice2.frontend import Frontend, only_punctuation
from voicebot.tts.cosyvoice2.lm import PromptPrefix, unistream
from voicebot.tts.cosyvoice2.lm_pool import LMPool, LMRow
from voicebot.tts.cosyvoice2.loader import CosyVoice2Modules, load_cosyvoice2, resolve_device, resolve_dtype, resolve_model_dir
from voicebot.tts.cosyvoice2.quant import quantize_lm
from voicebot.tts.cosyvoice2.sampling import RasSampler
from voicebot.tts.cosyvoice2.speech_job import PlaybackClock, SpeechJob
from voicebot.tts.cosyvoice2.token2wav import Token2Wav
from voicebot.tts.cosyvoice2.token2wav_stream import ChunkRequest, Token2WavStream
from voicebot.tts.cosyvoice2.voice_prompts import VoicePrompts, flow_prompt
from voicebot.tts.cosyvoice2.voices import Voice, VoiceLibrary

log = logging.getLogger(__name__)

CONFIG_KEY = "tts.cosyvoice2.model"
SESSION_LIFETIMES = 64  # closed sessions' lifetimes kept for the retry-after estimate
DEFAULT_RETRY_AFTER_S = 30.0  # before any session has closed


# --- the shared engine


class CosyVoice2Synthesizer(Synthesizer):
    name = "cosyvoice2"

    def __init__(self, config: Cosyvoice2Config, default_voice: str) -> None:
        self.config = config
        self.default_voice = default_voice
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.scheduler: Scheduler | None = None
        self._render_stream: torch.cuda.Stream | None = None  # CUDA: renders run there, beside the LM
        self.library: VoiceLibrary | None = None
        self.contexts: set[CosyVoice2Context] = set()
        self.model_dir: Path | None = None
        self.voice_prompts: VoicePrompts | None = None  # once served
        # Voice states are derived here, one at a time, beside the scheduler (never on it). Not
        # in workers(): its rare seconds-long calls are no session's load for admission control.
        self.voice_worker = Worker("cosyvoice2-voices", threads=1)
        self._lifetimes: deque[float] = deque(maxlen=SESSION_LIFETIMES)

    def load(self) -> None:
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.model_dir = resolve_model_dir(self.config.model, self.config.model_cache, CONFIG_KEY)
        modules = load_cosyvoice2(self.model_dir, self.device, self.dtype)
        library = VoiceLibrary(Frontend.from_model_dir(self.model_dir, cuda=self.device.type == "cuda"),
                               self.config.voice_cache_dir)
        if (self.model_dir / "spk2info.pt").is_file():
            library.load_spk2info(self.model_dir / "spk2info.pt")
        if self.config.voices_dir and Path(self.config.voices_dir).is_dir():
            library.load_dir(self.config.voices_dir)
        self.serve(modules, library)

    def serve(self, modules: CosyVoice2Modules, library: VoiceLibrary) -> None:
        """Serve these modules and voices: `load` does it with the configured model directory,
        bench/serve.py with released-size modules of random weights."""
        self.model_dir, self.hparams, self.lm = modules.model_dir, modules.hparams, modules.lm
        if self.config.lm_int8:  # after the strict checkpoint load: the wrappers change the module tree
            quantize_lm(self.lm)
        # On CUDA with a bounded flow window, flow and HiFT run at bucketed static shapes, every
        # bucket captured as a CUDA graph now, before any render (token2wav.py, flow_window.py).
        bucketed = self.device.type == "cuda" and self.config.cuda_graphs and self.config.flow_left_chunks >= 0
        self.token2wav = Token2Wav(modules.flow, modules.hift, mode=self.config.stream_mode,
                                   max_prompt_states=self.config.flow_prompt_states,
                                   flow_left_chunks=self.config.flow_left_chunks,
                                   max_render_streams=self.config.render_batch, bucketed=bucketed,
                                   max_streams=self.config.batch_slots)  # one stream per LM slot
        if bucketed:
            began = time.perf_counter()
            n_graphs = self.token2wav.capture_graphs()
            log.info("cosyvoice2: %d render graphs (flow and HiFT buckets) captured in %.1f s", n_graphs,
                     time.perf_counter() - began)
        if self.default_voice not in library:
            raise ValueError(f"tts.voice {self.default_voice!r} is not a CosyVoice 2 voice; have {library.names()}")
        self.library = library
        pool = LMPool(self.lm, self.config.batch_slots, self.config.kv_cache_tokens, self.config.prefill_chunk_tokens,
                      graphs=self.device.type == "cuda" and self.config.cuda_graphs)
        self.scheduler = Scheduler(f"cosyvoice2-{self.device}", pool, self._render,
                                   max_render_batch=self.config.render_batch,
                                   render_budget=self.token2wav.render_budget(),
                                   sample_rate=SAMPLE_RATE, tokens_per_s=self.hparams["token_frame_rate"])
        self.voice_prompts = VoicePrompts(library, self.lm, self.token2wav, self.scheduler, self.voice_worker,
                                          self.config, self.device, self.dtype)
        self.voice_prompts.warm(library[self.default_voice])
        self.scheduler.calibrate(render_probe=functools.partial(self._probe_chunks, library[self.default_voice]))
        self.scheduler.start()
        log.info("cosyvoice2 loaded from %s on %s/%s, %d voices, %d LM slots (%.0f MiB), capacity %s sessions",
                 self.model_dir, self.device, self.dtype, len(library.names()), pool.slots, pool.nbytes() / 2**20,
                 self.scheduler.capacity())

    def _probe_chunks(self, voice: Voice) -> list[ChunkRequest]:
        """A reply's first chunk in the default voice (token 0 throughout): what calibration times
        a render with, so admission knows the render cost before the first reply. One stream's,
        alone: the dearest per second of audio, as a start."""
        stream = self.token2wav.stream(flow_prompt(voice, self.device, self.dtype),
                                       generator=torch.Generator(self.device).manual_seed(0))
        stream.add([0] * stream.tokens_for_next_chunk)
        return [stream.next_chunk()]

    def _render(self, chunks: list[ChunkRequest]) -> list[np.ndarray] | Rendering:
        """The chunks' audio; on CUDA, launched on the render stream and handed back running (the
        scheduler steps the LM meanwhile: Token2Wav.launch)."""
        if self.device.type != "cuda":
            return [audio.reshape(-1).float().numpy() for audio in self.token2wav.render(chunks)]
        if self._render_stream is None:
            self._render_stream = torch.cuda.Stream(self.device)
        return self.token2wav.launch(chunks, self._render_stream)

    def voices(self) -> list[VoiceInfo]:
        return self.library.list() if self.library else []

    def register_metrics(self, registry) -> None:
        register_scheduler_metrics(registry, self.scheduler)
        register_voice_refreshes(registry, lambda: self.voice_prompts.refreshes_failed if self.voice_prompts else 0)

    def full(self) -> float | None:
        """None while one more session fits; else seconds after which to retry. One more fits
        while the sessions open, each speaking `admission_duty` of the time, stay in real time at
        the measured step costs; the first always does (it slows nobody else)."""
        capacity = self.scheduler.capacity() if self.scheduler else None
        speaking = math.ceil((len(self.contexts) + 1) * self.config.admission_duty)
        if not self.contexts or capacity is None or speaking <= capacity:
            return None
        return self._retry_after()

    def admit(self) -> float | None:
        retry_after = self.full()
        if retry_after is not None:
            self.scheduler.refused += 1
        return retry_after

    def _retry_after(self) -> float:
        """Room comes back when a session closes: the median lifetime of closed sessions, less the
        age of the oldest open one."""
        if not self._lifetimes:
            return DEFAULT_RETRY_AFTER_S
        oldest = time.monotonic() - min(c.opened for c in self.contexts)
        return round(max(1.0, statistics.median(self._lifetimes) - oldest), 1)

    def open(self, voice: str | None = None) -> CosyVoice2Context:
        kind = CosyVoice2BistreamContext if self.config.text_input == "bistream" else CosyVoice2Context
        context = kind(self, self._check_voice(voice or self.default_voice))
        self.contexts.add(context)
        return context

    def _closed(self, context: CosyVoice2Context) -> None:
        if context in self.contexts:
            self.contexts.discard(context)
            self._lifetimes.append(time.monotonic() - context.opened)

    def info(self) -> EngineInfo:
        loaded = self.library is not None
        # The LM's attention kernel; the flow's is always SDPA (its chunk masks are not causal).
        details = {"dtype": str(self.dtype).removeprefix("torch."), "attention": self.lm.attention if loaded else None,
                   "lm_int8": self.config.lm_int8, "text_input": self.config.text_input, "kv_cache_tokens": self.config.kv_cache_tokens,
                   "sessions": len(self.contexts),
                   "voice_refreshes_failed": self.voice_prompts.refreshes_failed if self.voice_prompts else 0}
        if loaded:
            details |= {"model_dir": str(self.model_dir), "voices": self.library.names(),
                        "stream_mode": self.token2wav.mode, "voice_state_bytes": self.library.nbytes(),
                        "flow_prompt_state_bytes": sum(self.token2wav.prompt_state_bytes().values()),
                        "lm_prefix_bytes": self.voice_prompts.lm_prefix_bytes(),
                        "lm_pool_bytes": self.scheduler.pool.nbytes(), "scheduler": self.scheduler.stats()}
        return EngineInfo("tts", self.name, str(self.device), loaded, details)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        self.voice_worker.shutdown()

    def _check_voice(self, voice: str) -> str:
        if self.library is None or voice not in self.library:
            raise KeyError(voice)
        return voice

    def sampler(self, generator: torch.Generator) -> RasSampler:
        return RasSampler.from_hparams(self.hparams["llm"]["sampling"], generator)


# --- one session

async def _then_end(text: AsyncIterator[str]) -> AsyncIterator[str | None]:
    """The deltas, then None once they end."""
    async for delta in text:
        yield delta
    yield None


class CosyVoice2Context(SentenceSynthesisContext):
    def __init__(self, engine: CosyVoice2Synthesizer, voice: str) -> None:
        self.engine = engine
        self.voice = voice
        self.generation = 0
        self.opened = time.monotonic()
        self.clock = PlaybackClock()
        # One generator for the LM sampler and the vocoder noise: each utterance draws in one fixed order.
        self.generator = torch.Generator(engine.device)
        self.generator.seed()

    def set_voice(self, voice: str) -> None:
        self.voice = self.engine._check_voice(voice)

    async def stream(self, text: AsyncIterator[str]) -> AsyncIterator[SpeechChunk]:
        self.clock.reply_started()
        async for chunk in super().stream(text):
            yield chunk

    async def speak(self, sentence: str, segment: int) -> AsyncIterator[SpeechChunk]:
        engine = self.engine
        text_frontend = engine.library.frontend.text
        voice = engine.library[self.voice]
        for utterance_text in text_frontend.split(sentence):
            ids = text_frontend.encode(utterance_text)
            job = await self.open_utterance(voice, functools.partial(self._unistream, voice, ids))
            try:
                async for piece in job.chunks(finish=True):
                    yield SpeechChunk(piece, sentence, segment)
            finally:
                job.close()

    async def open_utterance(self, voice: Voice, start) -> SpeechJob:
        """An LM slot (the voice's prompt prefix in it, in sentences mode) and what
        `start(row, prefix)` makes of it on the scheduler thread (its token stream, and the text
        side of a bistream utterance); the caller must close() it."""
        scheduler, deadline = self.engine.scheduler, self.clock.deadline()
        prefix = None
        if self.engine.config.text_input == "sentences":
            prefix = await scheduler.call(functools.partial(self.engine.voice_prompts.lm_prefix, voice), deadline)
        row = await scheduler.open_row(self.engine.sampler(self.generator), prefix, deadline)
        try:
            stream, bistream = await scheduler.call(functools.partial(start, row, prefix), deadline)
        except BaseException:
            scheduler.release(row)
            raise
        return SpeechJob(scheduler, row, stream, self.clock, bistream)

    def _unistream(self, voice: Voice, ids: list[int], row: LMRow, prefix: PromptPrefix) -> tuple[Token2WavStream, None]:
        engine = self.engine
        dev = engine.device
        program = unistream(engine.lm, engine.scheduler.pool.max_seq_len, ids, voice.prompt_text.to(dev),
                            voice.lm_prompt_speech.to(dev), prefix=prefix)
        engine.scheduler.pool.start(row, program)
        return engine.token2wav.stream(flow_prompt(voice, dev, engine.dtype), generator=self.generator), None

    async def reset(self) -> ResetReport:
        """Sessions hold no LM state between replies (a slot lives one utterance), so what a reset
        renews is the voice's shared prompt state: re-derived beside the scheduler, swapped in."""
        freed = await self.engine.voice_prompts.refresh(self.voice)
        if freed is None:  # the derivation failed: the voice keeps its state, nothing was renewed
            return ResetReport(self.engine.name, self.generation, 0, skipped=True)
        self.generation += 1
        return ResetReport(self.engine.name, self.generation, freed)

    async def close(self) -> None:
        self.engine._closed(self)


class CosyVoice2BistreamContext(CosyVoice2Context):
    """Reply text streamed into the LM as it arrives (official inference_bistream, spec §6.4).

    Text is pushed into one LM request a word at a time (`WordFeed`), as the official bistream
    takes the text tokens as they come, so the first speech token can follow the first few words
    instead of the first sentence; the request decodes whatever the text so far unlocks. A new
    request starts at a sentence boundary once the current one is `full`. The chunks of one request
    form one segment whose text grows with it: where inside it the audio is, sentence by sentence,
    is not known, so an interruption's heard text is a proportion of it.
    """

    async def stream(self, text: AsyncIterator[str]) -> AsyncIterator[SpeechChunk]:
        engine = self.engine
        voice = engine.library[self.voice]
        self.clock.reply_started()
        job: SpeechJob | None = None
        state: BistreamText | None = None
        segment = -1
        feed = WordFeed()
        try:
            async for delta in _then_end(text):
                for piece, sentence_ends in feed.push(delta) if delta is not None else feed.flush():
                    if job is None and only_punctuation(piece):
                        continue  # nothing to voice yet: no request is started for it
                    if job is None:
                        job = await self.open_utterance(voice, functools.partial(self._bistream, voice))
                        state = job.bistream
                        segment += 1
                    if piece.strip():
                        await engine.scheduler.call(functools.partial(state.push_text, piece), self.clock.deadline())
                        async for audio in job.chunks(finish=False):
                            yield SpeechChunk(audio, state.text, segment)
                    if sentence_ends and state.full:
                        async for chunk in self._end(job, state, segment):
                            yield chunk
                        job.close()
                        job = state = None
            if job is not None:
                async for chunk in self._end(job, state, segment):
                    yield chunk
        finally:
            if job is not None:
                job.close()

    def _bistream(self, voice: Voice, row: LMRow, prefix: None) -> tuple[Token2WavStream, BistreamText]:
        engine = self.engine
        dev, pool = engine.device, engine.scheduler.pool
        stream = engine.token2wav.stream(flow_prompt(voice, dev, engine.dtype), generator=self.generator)
        lm = Bistream(engine.lm, pool.max_seq_len, voice.prompt_text.to(dev), voice.lm_prompt_speech.to(dev))
        return stream, BistreamText(pool, row, lm, engine.library.frontend.text)

    async def _end(self, job: SpeechJob, state: BistreamText, segment: int) -> AsyncIterator[SpeechChunk]:
        await self.engine.scheduler.call(state.end_text, self.clock.deadline())
        async for piece in job.chunks(finish=True):
            yield SpeechChunk(piece, state.text, segment)
        if state.lm.truncated:
            log.warning("cosyvoice2: utterance cut at the LM's length limit or KV slot end (%d positions): %r",
                        state.lm.pos, state.text)
