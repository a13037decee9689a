"""espeak-ng through `espeakng-loader`: a synthesizer that needs no downloads.

espeak-ng is GPL-3.0-or-later. Its library is loaded at run time, only when a config selects this
engine. It speaks whole sentences, so the reply text goes through the sentence segmenter; each
sentence is synthesized in one worker call (real-time factor about 0.002), its buffers collected
through espeak's synthesis callback, and resampled from 22 050 Hz to 24 kHz.
The library's state is global: one synthesis at a time per process (one worker thread).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import AsyncIterator

import numpy as np

from voicebot.audio.resample import StreamResampler
from voicebot.config.engines import EspeakConfig
from voicebot.engine_reports import EngineInfo, ResetReport
from voicebot.serving.worker import Worker
from voicebot.tts.base import SAMPLE_RATE, SentenceSynthesisContext, SpeechChunk, Synthesizer, VoiceInfo

AUDIO_OUTPUT_SYNCHRONOUS = 2
ESPEAK_CHARS_UTF8 = 1
ESPEAK_RATE = 1
CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
# Audio handed to the session in pieces of this size, so the first frame can leave early.
CHUNK_SAMPLES = SAMPLE_RATE // 10


class _Library:
    """The process's one espeak-ng instance: its state, callback included, is global in C."""

    _instance: "_Library | None" = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        import espeakng_loader

        self._lib = ctypes.CDLL(espeakng_loader.get_library_path())
        data_parent = str(Path(espeakng_loader.get_data_path()).parent).encode()
        self.rate = self._lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 100, data_parent, 0)
        if self.rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed ({self.rate}); data path {data_parent!r}")
        self._lock = threading.Lock()
        self._collected: list[np.ndarray] = []
        self._cancel: threading.Event | None = None
        self._callback = CALLBACK(self._on_audio)  # keep a reference: espeak calls it from C
        self._lib.espeak_SetSynthCallback(self._callback)

    @classmethod
    def get(cls) -> "_Library":
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def has_voice(self, espeak_voice: str) -> bool:
        with self._lock:
            return self._lib.espeak_SetVoiceByName(espeak_voice.encode()) == 0

    def synthesize(self, text: str, espeak_voice: str, rate_wpm: int, cancel: threading.Event) -> np.ndarray:
        """One sentence at the library's native rate (blocking)."""
        with self._lock:
            self._collected, self._cancel = [], cancel
            self._lib.espeak_SetVoiceByName(espeak_voice.encode())
            self._lib.espeak_SetParameter(ESPEAK_RATE, rate_wpm, 0)
            data = text.encode("utf-8")
            self._lib.espeak_Synth(data, len(data) + 1, 0, 0, 0, ESPEAK_CHARS_UTF8, None, None)
            audio = np.concatenate(self._collected) if self._collected else np.zeros(0, np.float32)
            self._collected, self._cancel = [], None
        return audio

    def _on_audio(self, wav, n: int, _events) -> int:
        if wav and n > 0:
            self._collected.append(np.ctypeslib.as_array(wav, shape=(n,)).astype(np.float32) / 32768.0)
        return 1 if self._cancel is not None and self._cancel.is_set() else 0


class EspeakSynthesizer(Synthesizer):
    name = "espeak"

    def __init__(self, config: EspeakConfig, default_voice: str) -> None:
        self.config = config
        self.default_voice = default_voice
        self.worker = Worker("espeak", threads=1)
        self.library: _Library | None = None

    def load(self) -> None:
        if self.default_voice not in self.config.voices:
            raise ValueError(f"tts.voice {self.default_voice!r} is not one of tts.espeak.voices {sorted(self.config.voices)}")
        library = _Library.get()
        for name, espeak_voice in self.config.voices.items():
            if not library.has_voice(espeak_voice):
                raise ValueError(f"tts.espeak.voices.{name}: espeak-ng has no voice {espeak_voice!r}")
        self.library = library

    def voices(self) -> list[VoiceInfo]:
        return [VoiceInfo(name, language=v, description=f"espeak-ng {v}") for name, v in self.config.voices.items()]

    def open(self, voice: str | None = None) -> "EspeakContext":
        return EspeakContext(self, self._check_voice(voice or self.default_voice))

    def info(self) -> EngineInfo:
        rate = self.library.rate if self.library else 0
        return EngineInfo("tts", self.name, "cpu", self.library is not None, {"native_rate": rate, "voices": list(self.config.voices)})

    def workers(self) -> list[Worker]:
        return [self.worker]

    def close(self) -> None:
        self.worker.shutdown()

    def _check_voice(self, voice: str) -> str:
        if voice not in self.config.voices:
            raise KeyError(voice)
        return voice

    def synthesize(self, text: str, voice: str, cancel: threading.Event) -> np.ndarray:
        return self.library.synthesize(text, self.config.voices[voice], self.config.rate_wpm, cancel)


class EspeakContext(SentenceSynthesisContext):
    """espeak keeps no state between sentences; a reset only advances the generation."""

    def __init__(self, engine: EspeakSynthesizer, voice: str) -> None:
        self.engine = engine
        self.voice = voice
        self.generation = 0

    def set_voice(self, voice: str) -> None:
        self.voice = self.engine._check_voice(voice)

    async def speak(self, sentence: str, segment: int) -> AsyncIterator[SpeechChunk]:
        cancel = threading.Event()
        try:
            native = await self.engine.worker.run(self.engine.synthesize, sentence, self.voice, cancel)
        finally:
            cancel.set()  # if we were cancelled while queued or running, espeak aborts at its next buffer
        resampler = StreamResampler(self.engine.library.rate, SAMPLE_RATE)
        audio = np.concatenate([resampler.process(native), resampler.flush()])
        for start in range(0, len(audio), CHUNK_SAMPLES):
            yield SpeechChunk(audio[start : start + CHUNK_SAMPLES], sentence, segment)

    async def reset(self) -> ResetReport:
        self.generation += 1
        return ResetReport(self.engine.name, self.generation, 0)

    async def close(self) -> None:
        pass
