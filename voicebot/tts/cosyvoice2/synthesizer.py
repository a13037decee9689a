"""CosyVoice 2 as the server's Synthesizer: reply text deltas in, 24 kHz audio chunks out.

Text is cut into sentences as it arrives (SentenceSegmenter) and normalised. With `text_input:
bistream` (the default) a reply is pushed a word at a time (`WordFeed`) into an LM request that
mixes text and speech tokens (official inference_bistream), a new request at a sentence end every
60-odd text tokens; with `text_input: sentences` each sentence, split into utterances if long, is
one official unistream request, which starts from the voice's cached LM prompt prefix.

All model work runs on the device's `Scheduler` thread (voicebot/serving/scheduler.py): each
utterance holds a slot of the pooled LM cache for its life, the decode steps of every speaking
session run as one batch, and the flow/HiFT chunks their tokens complete run earliest deadline
first, the chunks of several sessions in one flow call and one HiFT call (Token2Wav.render).
`SpeechJob.chunks` is the step loop: tokens up to the next chunk boundary, then that chunk's audio,
so each session's generator is drawn in one fixed order whoever else is speaking, and a cancelled
reply leaves the batch at the next step.

A voice's prompt state (features, LM prefix, flow prompt state) is derived once per voice on a
background thread and swapped in between steps: a session's periodic reset never stalls the others.
That thread is a `Worker`'s, so a derivation that fails in any way (SystemExit included) or whose
thread dies fails only that reset: the voice keeps the state it had, and the next reset derives again.
"""

from __future__ import annotations

import asyncio
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
from voicebot.serving.scheduler import Rendering, Scheduler
from voicebot.serving.worker import Worker
from voicebot.tts.base import SAMPLE_RATE, SentenceSynthesisContext, SpeechChunk, Synthesizer, VoiceInfo
from voicebot.tts.segmenter import CLAUSE_MARKS, SentenceSegmenter
from voicebot.tts.cosyvoice2.bistream import Bistream
from voicebot.tts.cosyvoice2.flow import FlowCache
from voicebot.tts.cosyvoice2.frontend import Frontend, language, only_punctuation
from voicebot.tts.cosyvoice2.lm import PromptPrefix, prompt_prefix, unistream
from voicebot.tts.cosyvoice2.lm_pool import LMPool, LMRow
from voicebot.tts.cosyvoice2.loader import CosyVoice2Modules, load_cosyvoice2, resolve_device, resolve_dtype, resolve_model_dir
from voicebot.tts.cosyvoice2.quant import quantize_lm
from voicebot.tts.cosyvoice2.sampling import RasSampler
from voicebot.tts.cosyvoice2.token2wav import ChunkRequest, FlowPrompt, Token2Wav, Token2WavStream
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
        # voice name -> (the Voice it was computed from, its LM prompt prefix); scheduler thread only
        self._lm_prefixes: dict[str, tuple[Voice, PromptPrefix]] = {}
        # Voice states are derived here, one at a time, beside the scheduler (never on it). Not
        # in workers(): its rare seconds-long calls are no session's load for admission control.
        self.voice_worker = Worker("cosyvoice2-voices", threads=1)
        self.refreshes_failed = 0  # resets skipped: their derivation failed, the old state kept
        self._refreshing: dict[str, asyncio.Future[int | None]] = {}  # voice -> its refresh in flight
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
        self.token2wav = Token2Wav(modules.flow, modules.hift, mode=self.config.stream_mode,
                                   max_prompt_states=self.config.flow_prompt_states,
                                   flow_left_chunks=self.config.flow_left_chunks)
        if self.default_voice not in library:
            raise ValueError(f"tts.voice {self.default_voice!r} is not a CosyVoice 2 voice; have {library.names()}")
        self.library = library
        self._warm_flow_prompt_state(library[self.default_voice])
        pool = LMPool(self.lm, self.config.batch_slots, self.config.kv_cache_tokens, self.config.prefill_chunk_tokens,
                      graphs=self.device.type == "cuda" and self.config.cuda_graphs)
        self.scheduler = Scheduler(f"cosyvoice2-{self.device}", pool, self._render,
                                   max_render_batch=self.config.render_batch,
                                   sample_rate=SAMPLE_RATE, tokens_per_s=self.hparams["token_frame_rate"])
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
        register_voice_refreshes(registry, lambda: self.refreshes_failed)

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
                   "sessions": len(self.contexts), "voice_refreshes_failed": self.refreshes_failed}
        if loaded:
            details |= {"model_dir": str(self.model_dir), "voices": self.library.names(),
                        "stream_mode": self.token2wav.mode, "voice_state_bytes": self.library.nbytes(),
                        "flow_prompt_state_bytes": sum(self.token2wav.prompt_state_bytes().values()),
                        "lm_prefix_bytes": sum(prefix.nbytes() for _, prefix in list(self._lm_prefixes.values())),
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

    def lm_prefix(self, voice: Voice) -> PromptPrefix:
        """The voice's [sos | prompt text] LM keys/values, computed once per Voice object: a
        refreshed voice (a new object) comes with its own. Scheduler thread only."""
        cached = self._lm_prefixes.get(voice.name)
        if cached is None or cached[0] is not voice:
            cached = (voice, prompt_prefix(self.lm, voice.prompt_text))
            self._lm_prefixes[voice.name] = cached
        return cached[1]

    # --- voice refresh (the periodic reset), off the scheduler

    async def refresh_voice(self, name: str) -> int | None:
        """Re-derive a voice's state from its source and swap it in; the bytes of the state it
        replaced, or None when the derivation failed and the voice keeps its state. Concurrent
        calls for one voice share one derivation (the later ones get 0, or None)."""
        if name in self._refreshing:
            return 0 if await asyncio.shield(self._refreshing[name]) is not None else None
        future = asyncio.get_running_loop().create_future()
        self._refreshing[name] = future
        try:
            try:
                fresh = await self.voice_worker.run(self._derive_voice, name)
            except Exception:  # JobAborted and WorkerThreadLost too: the worker turned them into these
                self.refreshes_failed += 1
                log.exception("cosyvoice2: deriving voice %r failed; it keeps its state until the next reset", name)
                future.set_result(None)
                return None
            freed = await self.scheduler.call(functools.partial(self._swap_voice, *fresh), deadline=math.inf)
            future.set_result(freed)
            return freed
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: joiners may be gone
            raise
        finally:
            del self._refreshing[name]

    def _derive_voice(self, name: str) -> tuple[Voice, PromptPrefix | None, FlowCache]:
        """On the voices thread: everything a voice's replies read, computed from its source. The
        models' weights are only read, so this runs beside the scheduler's steps."""
        torch.set_num_threads(1)  # this thread's own intra-op pool: the scheduler's cores stay its
        voice = self.library.derive(name)
        prefix = prompt_prefix(self.lm, voice.prompt_text) if self.config.text_input == "sentences" else None
        prompt = flow_prompt(voice, self.device, self.dtype)
        return voice, prefix, self.token2wav.new_prompt_state(prompt)

    def _swap_voice(self, voice: Voice, prefix: PromptPrefix | None, flow_state: FlowCache) -> int:
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

    def _warm_flow_prompt_state(self, voice: Voice) -> None:
        # The flow's prompt state takes seconds on CPU: pay it now, not in the next reply.
        self.token2wav.prompt_state(flow_prompt(voice, self.device, self.dtype))


class WordFeed:
    """Streamed reply text -> the pieces to push into a bistream request, each as soon as its words
    are complete: `push(delta)` and `flush()` give (piece, ends a sentence) pairs. A word is complete
    once a space or a clause mark follows it (Chinese, which has no spaces, goes a clause at a time);
    a sentence (SentenceSegmenter) ends with the rest of its text. A piece starts with the space
    before its first word, so " world," tokenizes as inside the whole text, and the pieces put
    together are the text as written.

    Bounds: it holds the unfinished sentence, which the segmenter cuts at max_chars (150)."""

    def __init__(self) -> None:
        self.segmenter = SentenceSegmenter()
        self.text = ""  # the unfinished sentence as received, from the end of the last one
        self.fed = 0  # characters of `text` already given out as pieces

    def push(self, delta: str) -> list[tuple[str, bool]]:
        self.text += delta
        pieces = [piece for sentence in self.segmenter.push(delta) for piece in self._sentence(sentence)]
        # The complete words end before the last space (which goes with the next word) or after
        # the last clause mark.
        words_end = max((i + (c in CLAUSE_MARKS) for i, c in enumerate(self.text)
                         if i >= self.fed and (c.isspace() or c in CLAUSE_MARKS)), default=self.fed)
        if self.text[self.fed : words_end].strip():
            pieces.append((self.text[self.fed : words_end], False))
            self.fed = words_end
        return pieces

    def flush(self) -> list[tuple[str, bool]]:
        rest = self.segmenter.flush()
        return self._sentence(rest) if rest else []

    def _sentence(self, sentence: str) -> list[tuple[str, bool]]:
        """The rest of a sentence the segmenter completed (its text, stripped, starts at the first
        character after the previous sentence that is not a space)."""
        start = len(self.text) - len(self.text.lstrip())
        end = self.text.index(sentence, start) + len(sentence)
        rest, self.text, self.fed = self.text[self.fed : end], self.text[end:], 0
        return [(rest, True)] if rest.strip() else [("", True)]


async def _then_end(text: AsyncIterator[str]) -> AsyncIterator[str | None]:
    """The deltas, then None once they end."""
    async for delta in text:
        yield delta
    yield None


def flow_prompt(voice: Voice, device: torch.device, dtype: torch.dtype) -> FlowPrompt:
    return FlowPrompt(voice.flow_prompt_speech.to(device), voice.prompt_feat.to(device, dtype),
                      voice.embedding.to(device, dtype))


# --- one utterance, one session


class PlaybackClock:
    """When a session's listener runs out of the audio yielded so far: the deadline of its
    requests. A new reply has nothing buffered, so its first requests are already due."""

    def __init__(self) -> None:
        self.until = 0.0

    def reply_started(self) -> None:
        self.until = time.monotonic()

    def deadline(self) -> float:
        return self.until

    def played(self, samples: int) -> None:
        self.until = max(self.until, time.monotonic()) + samples / SAMPLE_RATE


class SpeechJob:
    """One utterance in flight: its LM row (a slot of the pool, fed by one program after another)
    and the Token2WavStream its tokens render through.

    `chunks()` is the step loop every driver uses (the contexts below, bench/, tests): it asks the
    scheduler for the tokens up to the next chunk boundary, then for that chunk's audio, until the
    row's program ends. `close()` frees the slot (always call it: a cancelled reply included). The
    stream's token list is touched here, on the loop, only while no request of it is in flight.
    """

    def __init__(self, scheduler: Scheduler, row: LMRow, stream: Token2WavStream, clock: PlaybackClock,
                 bistream: _BistreamState | None = None) -> None:
        self.scheduler, self.row, self.stream, self.clock = scheduler, row, stream, clock
        self.bistream = bistream  # the text side of a bistream utterance

    async def chunks(self, finish: bool) -> AsyncIterator[np.ndarray]:
        """Audio until the row's program ends, then the utterance's last chunk if `finish`."""
        ended = False
        while not ended:
            # Never decode past the next chunk's last token: its audio goes out first.
            wanted = max(1, self.stream.tokens_for_next_chunk - len(self.stream.tokens))
            tokens, ended = await self.scheduler.decode(self.row, wanted, self.clock.deadline())
            self.stream.add(tokens)
            async for piece in self._ready():
                yield piece
        if finish:
            self.stream.end()
            async for piece in self._ready():  # the last chunk
                yield piece

    async def _ready(self) -> AsyncIterator[np.ndarray]:
        while (chunk := self.stream.next_chunk()) is not None:
            audio = await self.scheduler.render(chunk, self.clock.deadline())
            if audio.size:  # the fast vocoder may hold a whole chunk back
                self.clock.played(len(audio))
                yield audio

    def close(self) -> None:
        self.scheduler.release(self.row)


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
            prefix = await scheduler.call(functools.partial(self.engine.lm_prefix, voice), deadline)
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
        freed = await self.engine.refresh_voice(self.voice)
        if freed is None:  # the derivation failed: the voice keeps its state, nothing was renewed
            return ResetReport(self.engine.name, self.generation, 0, skipped=True)
        self.generation += 1
        return ResetReport(self.engine.name, self.generation, freed)

    async def close(self) -> None:
        self.engine._closed(self)


class _BistreamState:
    """A bistream utterance's text side, on the scheduler thread."""

    def __init__(self, engine: CosyVoice2Synthesizer, row: LMRow, voice: Voice) -> None:
        dev = engine.device
        self.engine, self.row = engine, row
        self.lm = Bistream(engine.lm, engine.scheduler.pool.max_seq_len, voice.prompt_text.to(dev),
                           voice.lm_prompt_speech.to(dev))
        self.frontend = engine.library.frontend.text
        self.text = ""  # the sentences it voices so far

    @property
    def full(self) -> bool:
        """Start the next sentence in a new utterance: this one has the official utterance length
        (token_min_n text tokens), or has used half its KV slot."""
        return self.lm.n_text >= self.frontend.token_min_n or 2 * self.lm.pos > self.lm.max_seq_len

    def push_text(self, piece: str) -> None:
        """A piece of the reply as written (words, with the space before them): its tokens, as the
        official frontend tokenizes each piece a text generator yields."""
        # The space before the piece: "Hi." + " How" tokenizes as the whole text would.
        joiner = " " if self.text and piece[:1].isspace() and language(piece) == "en" else ""
        self.text += joiner + piece.strip()  # as written: what the pacer reports as heard
        self.engine.scheduler.pool.start(self.row, self.lm.push(self.frontend.encode(joiner + self.frontend.normalize(piece))))

    def end_text(self) -> None:
        self.engine.scheduler.pool.start(self.row, self.lm.finish())


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
        state: _BistreamState | None = None
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

    def _bistream(self, voice: Voice, row: LMRow, prefix: None) -> tuple[Token2WavStream, _BistreamState]:
        engine = self.engine
        stream = engine.token2wav.stream(flow_prompt(voice, engine.device, engine.dtype), generator=self.generator)
        return stream, _BistreamState(engine, row, voice)

    async def _end(self, job: SpeechJob, state: _BistreamState, segment: int) -> AsyncIterator[SpeechChunk]:
        await self.engine.scheduler.call(state.end_text, self.clock.deadline())
        async for piece in job.chunks(finish=True):
            yield SpeechChunk(piece, state.text, segment)
        if state.lm.truncated:
            log.warning("cosyvoice2: utterance cut at the LM's length limit or KV slot end (%d positions): %r",
                        state.lm.pos, state.text)
