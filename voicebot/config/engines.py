"""The engines' sections: the recognizer (asr), the voice (tts) and the responder (reply)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from voicebot.config.base import REPO_ROOT, Section


class PocketsphinxConfig(Section):
    # Phrases for a closed grammar (deterministic, for tests and demos); empty = general English LM.
    phrases: list[str] = []
    # The general LM's flat-lexicon second pass over the whole utterance, run after it ends: 180 ms
    # of CPU per utterance at p50 before its transcript is in (38 ms without), for no better words
    # on tests/turn_set.py's English turns (bench/pocketsphinx_finish.py). Off: the reply starts sooner.
    second_pass: bool = False
    # Decoders built at start-up and kept for the streams (voicebot/asr/pocketsphinx_decoders.py), split
    # among the processes (at least one each): a stream that finds one waiting builds nothing. A build
    # takes 0.2-0.6 s of CPU holding its process's GIL: on `processes: 0` the server's, and so the
    # loop; in a decoding process its own, where every other stream bound there waits out each build
    # a burst of connects beyond the pool needs. 27 MB each with a grammar, 90 MB with the general LM.
    # None: as many as fit in 480 MB (voicebot/asr/pocketsphinx.py's POOL_MB says why): 17 with a
    # grammar, 5 with the LM, split among the processes rounding down (2: 16 and 4).
    decoders: int | None = Field(None, ge=1)
    # Decoding processes (voicebot/asr/pocketsphinx_process.py): pocketsphinx holds the GIL for a whole
    # call, so it decodes in processes of its own, each stream bound to one. None: one per core, at
    # most 4 (voicebot/asr/pocketsphinx.py's MAX_AUTO_PROCESSES says why). 0: on two threads of the
    # server's own process, where every call stalls the event loop (as before; for comparison).
    processes: int | None = Field(None, ge=0)


class DialectFallbackConfig(Section):
    """Re-decode an utterance with a second model when the primary result is unsure."""

    # A local model directory or a ModelScope id of a FunASR Paraformer (streaming or offline
    # class); None disables the fallback.
    model: str | None = None
    # Below this utterance confidence (geometric mean of token posteriors) the fallback runs.
    # 0.7 is a starting point: fit it on your own labelled audio with scripts/calibrate_threshold.py.
    fallback_threshold: float = Field(0.7, gt=0, lt=1)
    # Which result wins when the fallback ran: the more confident one, or always the dialect's.
    prefer: Literal["higher_confidence", "dialect"] = "higher_confidence"
    # Stream every utterance through the dialect model as it arrives (streaming-class dialect
    # models only): a fallback then adds one flush at the endpoint instead of decoding the whole
    # utterance, for twice the recognition compute.
    parallel: bool = False


class ParaformerConfig(Section):
    """FunASR streaming Paraformer, an optional offline second pass and the dialect fallback.

    Every model is a local directory or a ModelScope id looked up in `model_cache`; nothing is
    downloaded at start-up: `python -m voicebot.models fetch --config FILE` does that ahead of time.
    """

    model: str = "iic/speech_paraformer-large_asr_nat-zh-cn-16k-common-vocab8404-online"
    # Offline Paraformer re-decoding each utterance at its endpoint (more accurate, and its
    # confidence decides the fallback); None keeps the streaming result.
    offline_model: str | None = None
    dialect: DialectFallbackConfig = DialectFallbackConfig()
    # fsmn-vad, used as the endpointer of the /funasr endpoint; None: utterances end only when
    # the client says so (or at endpoint.max_utterance_s).
    vad_model: str | None = None
    # FunASR's punctuation model (CTTransformer: ct-punc-c = iic/punc_ct-transformer_zh-cn-common-
    # vocab272727-pytorch, or ct-punc) on each utterance's final text, as FunASR's 2pass server
    # does: the final clients get, and the turn-taking words' evidence (docs/turn-taking.md).
    # None: finals unpunctuated. voicebot/asr/punctuation.py.
    punc_model: str | None = None
    model_cache: Path = REPO_ROOT / "models"
    # In 60 ms frames: [0, 10, 5] decodes every 600 ms with 300 ms look-ahead; [0, 8, 4] every
    # 480 ms with 240 ms (lower latency, slightly more compute per second of audio).
    chunk_size: tuple[int, int, int] = (0, 10, 5)
    # Chunks of attention history kept per stream. Bounded on purpose: -1 (unbounded) grows
    # a stream's cache by ~200 MB per minute, so it is not accepted.
    encoder_look_back: int = Field(4, ge=0, le=16)
    decoder_look_back: int = Field(1, ge=0, le=16)
    device: str = "cpu"
    # torch intra-op threads; process-wide, so every FunASR model shares the setting.
    threads: int = Field(1, ge=1)
    # paraformer-batched only: the most sessions' chunks in one model call (the rest wait one
    # step), and the weights' dtype (float16 on a GPU; float32 on CPU).
    max_batch: int = Field(32, ge=1, le=256)
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"


class AsrConfig(Section):
    # paraformer: funasr's streaming Paraformer, one session's chunk per call (the reference);
    # paraformer-batched: our implementation of the same model (voicebot/asr/sanm), every
    # session's chunk in one call per step; same models, same results (tests/asr/test_sanm_golden.py).
    engine: Literal["pocketsphinx", "paraformer", "paraformer-batched"] = "pocketsphinx"
    pocketsphinx: PocketsphinxConfig = PocketsphinxConfig()
    paraformer: ParaformerConfig = ParaformerConfig()


class EspeakConfig(Section):
    # voice name (as clients see it) -> espeak-ng voice.
    voices: dict[str, str] = {"en": "en-us", "zh": "cmn", "yue": "yue"}
    rate_wpm: int = Field(175, ge=80, le=450)


class Cosyvoice2Config(Section):
    # A local model directory (official layout), or a ModelScope id looked up in model_cache.
    model: str = "iic/CosyVoice2-0.5B"
    model_cache: Path = REPO_ROOT / "models"
    # Voices: <name>.wav plus its transcript <name>.txt; the model's spk2info.pt speakers are added.
    voices_dir: Path | None = REPO_ROOT / "voices" / "cosyvoice2"
    # Prompt features of each voice, keyed by a hash of wav, transcript and frontend model files.
    voice_cache_dir: Path = REPO_ROOT / ".cache" / "cosyvoice2-voices"
    device: str = "auto"  # "auto" (cuda when available), "cpu", "cuda", "cuda:1", ...
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # auto: float16 on CUDA, float32 on CPU
    # LM KV cache per session, in positions (prompt + text + speech tokens of one utterance).
    # Real model, fp32: 24 KiB per position, so 2048 positions = 48 MiB per session.
    kv_cache_tokens: int = Field(2048, ge=64, le=32768)
    # LM KV slots: utterances decoding at once, in one batch (voicebot/tts/cosyvoice2/lm_pool.py). One slot is
    # kv_cache_tokens positions: 16 x 48 MiB = 768 MiB fp32 at the default; a further utterance waits for a slot.
    batch_slots: int = Field(16, ge=1, le=64)
    # Prompt positions fed per scheduler iteration: a new request's prefill holds the others' decode
    # for about one step at most (64 positions cost about one 16-row step on the released model, CPU).
    prefill_chunk_tokens: int = Field(64, ge=1, le=4096)
    # Flow + HiFT chunks of different sessions rendered in one call, at most this many (each call
    # holds the LM for its whole duration: on CPU, keep it to a few chunks).
    render_batch: int = Field(8, ge=1, le=64)
    # CUDA graphs (CUDA only): the LM decode step per bucketed batch size and, with flow_left_chunks >= 0,
    # flow and HiFT per render bucket (voicebot/tts/cosyvoice2/flow_window.py), all captured at start-up.
    cuda_graphs: bool = True
    # Admission: the share of its time a session is expected to speak; sessions are admitted while
    # that many speaking at once stay in real time at the measured step costs.
    admission_duty: float = Field(1.0, gt=0, le=1)
    # How streamed chunks get their mel (voicebot/tts/cosyvoice2/token2wav.py): "exact" is the official
    # algorithm's output from cached prompt and earlier frames; "fast" also renders the final chunk
    # chunk-causally (slightly different audio there, much cheaper). The official algorithm itself
    # (Token2Wav mode "recompute") is the tests' and bench/cosyvoice2.py's reference, not a setting.
    stream_mode: Literal["exact", "fast"] = "fast"
    # How reply text reaches the LM: "bistream" pushes each sentence into one running request as it
    # arrives (official inference_bistream, one LM context across sentences); "sentences" runs one
    # official unistream request per sentence (it starts from the voice's cached LM prompt prefix).
    text_input: Literal["bistream", "sentences"] = "bistream"
    # Flow cache window (voicebot/tts/cosyvoice2/estimator.py EstimatorCache), in 50-frame chunks: -1 keeps
    # every frame of a reply (the official default; about 115 MB per second of speech, fp16, released size),
    # n >= 0 bounds a stream to its own chunk and the n before it (the official num_decoding_left_chunks;
    # n = 2: 229 MB whatever the reply's length). It changes the mel: measure it on your weights first
    # (python -m bench.gpu_proxy --only window).
    flow_left_chunks: int = Field(-1, ge=-1)
    # Voices whose flow prompt state stays cached (released model, fp32: about 230 MB per second of prompt).
    flow_prompt_states: int = Field(4, ge=1)
    # torch intra-op threads (process-wide, like asr.paraformer.threads); 0 leaves torch's default.
    threads: int = Field(0, ge=0)
    # Int8 LM decode steps (voicebot/tts/cosyvoice2/quant.py): under half the weight reads per
    # token (down_proj stays fp32), relative logit error <= 2 %. The kernels are CPU-only, so it needs `device: cpu`.
    lm_int8: bool = False

    @model_validator(mode="after")
    def _int8_on_cpu(self) -> "Cosyvoice2Config":
        # "auto" is refused too: it would turn into CUDA on a machine with a GPU.
        if self.lm_int8 and (self.device != "cpu" or self.dtype not in ("auto", "float32")):
            raise ValueError(f"lm_int8 needs device: cpu and dtype auto or float32 "
                             f"(have device {self.device!r}, dtype {self.dtype!r}): its int8 kernels are CPU-only")
        return self


class TtsConfig(Section):
    engine: Literal["espeak", "cosyvoice2"] = "espeak"
    voice: str = "en"
    espeak: EspeakConfig = EspeakConfig()
    cosyvoice2: Cosyvoice2Config = Cosyvoice2Config()


class PersonaConfig(Section):
    """A system prompt: inline `text`, or a UTF-8 `file` read once at start-up."""

    text: str | None = None
    file: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "PersonaConfig":
        if (self.text is None) == (self.file is None):
            raise ValueError("give exactly one of 'text' or 'file'")
        return self


class OpenAICompatConfig(Section):
    """Any OpenAI-compatible chat-completions endpoint (vLLM, Ollama, LM Studio, DashScope, OpenAI)."""

    base_url: str | None = None  # e.g. http://127.0.0.1:8000/v1 (the part before /chat/completions)
    model: str | None = None
    # Name of the environment variable holding the API key; the key itself never goes in a file.
    api_key_env: str | None = None
    temperature: float = Field(0.7, ge=0, le=2)
    max_tokens: int = Field(200, ge=1)
    connect_timeout_s: float = Field(3.0, gt=0)
    # Request sent to first content delta, per attempt: past it the attempt is retried.
    first_token_timeout_s: float = Field(5.0, gt=0)
    # After the first delta, the longest wait for the next: past it the stream is closed and the
    # reply ends with what was said (a stalled server otherwise holds the reply to total_timeout_s).
    # This and total_timeout_s also bound every other responder (the reply stage's deadline).
    idle_timeout_s: float = Field(10.0, gt=0)
    # Whole reply, retries included.
    total_timeout_s: float = Field(30.0, gt=0)
    # Retries happen only before the first delta: after that the listener has heard words.
    retries: int = Field(2, ge=0, le=5)
    retry_backoff_s: float = Field(0.25, ge=0)
    # Merged into the request body, e.g. {"chat_template_kwargs": {"enable_thinking": false}}.
    extra_body: dict[str, Any] = {}


class ReplyConfig(Section):
    engine: Literal["echo", "openai"] = "echo"
    # Conversation history kept per session, in turns (a user message plus the reply) and in
    # estimated tokens; the oldest turns go first when either is exceeded.
    max_history_turns: int = Field(20, ge=0)
    max_history_tokens: int = Field(3000, ge=0)
    # A reconnecting client's `session.start.resume` restores a conversation this long after its
    # socket closed; at most `resume_max_conversations` are kept.
    resume_ttl_s: float = Field(600.0, ge=0)
    resume_max_conversations: int = Field(1000, ge=0)
    persona: PersonaConfig | None = None
    # Voice name -> persona for that voice (a character per voice); others use `persona`.
    voice_personas: dict[str, PersonaConfig] = {}
    # Spoken instead of silence when the responder fails before saying anything.
    fallback_line: str = "Sorry, I lost my train of thought. Could you say that again?"
    # Words or phrases never spoken (case-insensitive, whole words for Latin script): replaced
    # by `blocklist_replacement` ("" skips them). `blocklist_file`: one per line, added to the list.
    blocklist: list[str] = []
    blocklist_file: Path | None = None
    blocklist_replacement: str = ""
    # A reply is cut (at a word boundary) after this many characters; 0 = no limit.
    max_reply_chars: int = Field(600, ge=0)
    openai: OpenAICompatConfig = OpenAICompatConfig()

    @model_validator(mode="after")
    def _openai_complete(self) -> "ReplyConfig":
        if self.engine == "openai" and not (self.openai.base_url and self.openai.model):
            raise ValueError("engine 'openai' needs reply.openai.base_url and reply.openai.model")
        return self
