"""Settings: a YAML file from configs/ plus VOICEBOT_* environment overrides, validated at start-up.

The file is named by `--config` or `VOICEBOT_CONFIG` (default configs/default.yaml). Environment
variables override it in pydantic-settings' nested form: `VOICEBOT_TTS__VOICE=yue` sets tts.voice.
Every section forbids unknown keys, so a typo in a YAML file stops start-up with a message naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, IPvAnyNetwork, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_sessions: int = Field(20, ge=1)
    # On SIGTERM: stop accepting sessions, let replies in progress finish for at most this long.
    shutdown_timeout_s: float = Field(10.0, ge=0)
    static_dir: Path = REPO_ROOT / "static"
    # Shared secret for exposed servers: every WebSocket (sessions, listeners, /obs/audio) must
    # present it (?token=, a `token.<TOKEN>` subprotocol, or `Authorization: Bearer`). None: open.
    # Set it through VOICEBOT_SERVER__TOKEN rather than in a committed file.
    token: str | None = Field(None, min_length=8)
    # With `token` set: a second token that opens /metrics only (a Prometheus scrape's bearer token),
    # so the scraper need not hold the one that drives the bot. /metrics takes either.
    metrics_token: str | None = Field(None, min_length=8)
    # Host names (Host header) the server answers to, besides IP addresses, localhost and `host`
    # itself: e.g. ["voice.example.com"], "*.example.com" for its subdomains, "*" for any. Any other
    # name is refused (403, WebSockets too): a web page on a domain made to resolve to this server
    # (DNS rebinding) would otherwise be "same-origin" with it. Probes (/healthz, /readyz) are exempt.
    allowed_hosts: list[str] = []
    # Listener connections (OBS overlays) across all channels; each queues at most ~600 KB.
    max_listeners: int = Field(50, ge=0)
    # Tests and troubleshooting only: keep the first N seconds of raw input of the 8 most recent
    # sessions in memory, served at /debug/input/{session_id}.wav. 0 = off (and no such route).
    record_input_s: float = Field(0.0, ge=0, le=60)
    # Download missing models (with progress) at start-up, as `python -m voicebot.models fetch`
    # does; off: start-up never touches the network and names what is missing.
    download_models: bool = False
    # Bound to anything but loopback without a token, the server refuses to start unless this is
    # set (then it warns): an open voice server on a network is anyone's (docs/security.md).
    allow_anonymous: bool = False
    # Web pages (Origin header) allowed to open a WebSocket, e.g. ["https://show.example.com"];
    # the server's own pages (same origin) always are, clients that send no Origin too. "*": any.
    allowed_origins: list[str] = []
    # A connection that has not sent session.start by then is closed (1008, start_timeout).
    start_timeout_s: float = Field(10.0, gt=0)
    # run_server.py: a TCP connection whose HTTP request head is not complete by then is closed
    # (one that sends nothing, slowloris); uvicorn alone waits for ever.
    handshake_timeout_s: float = Field(10.0, gt=0)
    # A started session on which the client has sent nothing (no audio, no event) for this long
    # while the bot is not replying is closed (1008, idle_timeout); so are /funasr connections.
    # Listeners are not sessions: they only receive. None: never.
    idle_timeout_s: float | None = Field(60.0, gt=0)
    # Per client address (voicebot/limits.py): WebSocket connections of every kind, and sessions
    # as max_sessions counts them. Past either: `busy`, close 1013. None: no limit. Loopback is an
    # address like any other.
    max_connections_per_client: int | None = Field(None, ge=1)
    max_sessions_per_client: int | None = Field(None, ge=1)
    # Proxies (addresses or CIDR networks) whose X-Forwarded-For names the client, e.g. the HAProxy
    # of deploy/haproxy; any other peer is the client itself, whatever it sends.
    trusted_proxies: list[IPvAnyNetwork] = []
    # FunASR's clients cannot present a token: with server.token set, clients in these networks use
    # the FunASR paths (/funasr, /, any path not served otherwise) without one. Nothing else does.
    funasr_tokenless_networks: list[IPvAnyNetwork] = []


class LimitsConfig(Section):
    """Flood protection: past these rates the session is closed (close code 4008)."""

    max_messages_per_s: float = Field(200.0, gt=0)
    # Audio bytes per second allowed, as a multiple of the session's real-time byte rate.
    max_audio_realtime_factor: float = Field(4.0, gt=1)
    # Each rate's allowance holds this long of it (voicebot/guards/flood.py): a client may catch up
    # after a network stall this long.
    window_s: float = Field(2.0, gt=0)
    # FunASR's clients send a file as fast as the server reads it (funasr-client in every mode, the
    # runtime's own clients in offline mode): this much audio more may come at once on /funasr.
    funasr_audio_burst_s: float = Field(60.0, ge=0)
    # A new session is refused (busy) when an engine thread pool that cannot batch would be busier
    # than this share of its threads' time with it (voicebot/serving/capacity.py).
    max_worker_load: float = Field(0.85, gt=0, le=1)
    # A chunk of input processed later than this after it arrived misses its deadline; a new session
    # is refused while more than 5 % of the last 5 s of chunks did (voicebot/serving/capacity.py).
    # A 20 ms chunk's trip through the front end, the VAD and the recognizer takes milliseconds on
    # an idle box; a listener hears the lag in every reply's start.
    max_input_lag_s: float = Field(0.25, gt=0)
    # Before a pool's cost per session is learnt, at most this many sessions are let in per 5 s.
    cold_start_sessions: int = Field(8, ge=1)


class GateConfig(Section):
    enabled: bool = True
    block_ms: float = Field(5.0, gt=0)
    # A block this many background standard deviations above the background mean is a candidate burst.
    threshold_std: float = Field(3.0, gt=0)
    # ... and must also be this many dB above the background mean energy (keeps quiet rooms sane).
    min_rise_db: float = Field(12.0, ge=0)
    # A burst longer than this is not an impulse (it is speech or sustained sound): it passes.
    max_burst_ms: float = Field(50.0, gt=0)
    mute_ms: float = Field(50.0, gt=0)
    # Lookahead used to judge whether a rise is short. Audio waits for it only while a burst may be
    # starting; a block no mute can reach goes out at once (voicebot/audio/gate.py).
    lookahead_ms: float = Field(50.0, ge=0, le=50)
    # Time constant of the background statistics (exponential moving average).
    background_tau_s: float = Field(2.0, gt=0)
    warmup_ms: float = Field(200.0, ge=0)
    # No block taken as background for this long: the room got louder; re-learn its background.
    relearn_s: float = Field(3.0, gt=0)


class EndpointConfig(Section):
    # Silero speech probability above which a 32 ms window counts as speech.
    threshold: float = Field(0.5, gt=0, lt=1)
    # End of utterance after this much silence. 500 ms: below ~400 ms normal pauses between phrases
    # split sentences (measured on espeak speech, and the usual figure for conversational
    # endpointing); every extra 100 ms adds directly to the reply latency.
    endpoint_silence_ms: int = Field(500, ge=100, le=5000)
    # Speech shorter than this is not an utterance (a click the gate let through, a cough).
    min_speech_ms: int = Field(150, ge=0)
    # Audio kept before the detected start so the first phoneme reaches the recognizer.
    pre_speech_ms: int = Field(300, ge=0, le=1000)
    # An utterance is cut (ended) after this long, so no stream grows without bound.
    max_utterance_s: float = Field(30.0, gt=1)
    # What ends a turn: "silence" waits endpoint_silence_ms; "smart" asks Smart Turn v3.2
    # (voicebot/audio/turn.py) whether the turn is complete once a short pause is heard. A server
    # that cannot load the model says so at start-up and in /readyz and uses "silence".
    turn: Literal["smart", "silence"] = "smart"
    # smart (docs/turn-taking.md; the defaults are bench/turn_offline.py's pick on half 0 of the turn
    # sets: the fastest setting with a p95 within 1.1 s on the natural-voice set and no more cut-offs
    # than the silence rule on any set). The first question after this much VAD silence (the action
    # delay; each 32 ms less is 32 ms less latency, at the price of more cut-ins: a "complete" lands
    # inside more of the user's short pauses) ...
    smart_pause_ms: int = Field(160, ge=100, le=2000)
    # ... asked early, at this much VAD silence (0: not), on the audio so far with its silent tail
    # repeated to the pause's length; its answer stands for the pause's if the user stays silent
    # until then. Exact in digital silence; in room noise it agrees with the pause's own answer
    # about as often as two noise samples do (bench/smart_turn.py). Sooner, a "complete" also lands
    # inside more short pauses (at 192 ms and 0.8, asked at 32 ms, cut-ins of espeak 22 -> 24 of 80,
    # Piper 67 -> 76 and 61 -> 67 of 182), which is why it is off by default ...
    smart_early_ms: int = Field(0, ge=0, le=2000)
    # ... then again each time the pause grows by this much while the answer is "incomplete" (each
    # question is a model call: ~80 ms of a core) ...
    smart_reask_ms: int = Field(160, ge=32, le=5000)
    # ... and the turn ends anyway after this much silence (the timeout: a thinking pause, a model
    # that keeps saying "incomplete"). 896: the end-of-speech-to-decision p95 within 1.1 s; it cuts
    # off every pause longer than itself.
    smart_limit_ms: int = Field(896, ge=100, le=10000)
    # Probability of "complete" at or above which the turn ends, at the first question ...
    smart_threshold: float = Field(0.8, gt=0, lt=1)
    # ... falling linearly with the silence asked about to this at smart_limit_ms (equal: flat): the
    # longer the pause, the less sure the model needs to be (the long tail of true ends it never
    # calls complete) ...
    smart_threshold_floor: float = Field(0.6, gt=0, lt=1)
    # ... after the transcript's last words moved the answer, in log-odds (voicebot/audio/turn_words.py;
    # 0: ignored): down when the turn stops on a conjunction, a preposition, an article, a filler
    # (3: 0.95 reads as 0.49) ...
    smart_words_hold: float = Field(3.0, ge=0, le=20)
    # ... up when it ends in a full stop or a question mark (a recognizer that punctuates) or, in
    # Mandarin, on a question particle (2: 0.5 reads as 0.88).
    smart_words_go: float = Field(2.0, ge=0, le=20)
    # smart: start the responder and synthesis on the transcript at each pause, into a holding
    # buffer; sent at once if the turn ends with that transcript, discarded (never heard, never in
    # the history) if the user goes on.
    prepare_replies: bool = True

    @model_validator(mode="after")
    def _smart_order(self) -> "EndpointConfig":
        if self.smart_pause_ms >= self.smart_limit_ms:
            raise ValueError(f"smart_pause_ms ({self.smart_pause_ms}) must be below smart_limit_ms ({self.smart_limit_ms})")
        if self.smart_threshold_floor > self.smart_threshold:
            raise ValueError(f"smart_threshold_floor ({self.smart_threshold_floor}) must not be above smart_threshold "
                             f"({self.smart_threshold})")
        if self.smart_early_ms >= self.smart_pause_ms:
            raise ValueError(f"smart_early_ms ({self.smart_early_ms}) must be below smart_pause_ms ({self.smart_pause_ms})")
        return self


class PacingConfig(Section):
    # Reply frames may be sent at most this far ahead of the client's playback clock.
    lead_ms: int = Field(400, ge=0, le=5000)
    # When synthesis is slower than real time, wait for this much audio before the first frame.
    prebuffer_ms: int = Field(0, ge=0, le=10000)
    # User speech at least this long while the bot speaks interrupts it (a cough does not).
    barge_in_min_ms: int = Field(300, ge=0)


class ResetConfig(Section):
    interval_s: float = Field(1800.0, gt=0)


class OutputConfig(Section):
    """The level of reply audio on air (voicebot/audio/loudness.py): every session's, hence what a
    channel's listeners (the OBS overlay) and /obs/audio's channel get."""

    # Integrated loudness (ITU-R BS.1770 / EBU R128) replies are held at: -16 LUFS sits with
    # streaming platforms' -14 to -16 and podcasts' -16; EBU broadcast is -23. null: as synthesized.
    loudness_lufs: float | None = Field(-16.0, ge=-40.0, le=-5.0)
    # True peak (4x oversampled) ceiling: -1 dBTP leaves room for a platform's lossy encoder.
    true_peak_dbtp: float = Field(-1.0, ge=-12.0, le=0.0)


class PocketsphinxConfig(Section):
    # Phrases for a closed grammar (deterministic, for tests and demos); empty = general English LM.
    phrases: list[str] = []
    # The general LM's flat-lexicon second pass over the whole utterance, run after it ends: 180 ms
    # of CPU per utterance at p50 before its transcript is in (38 ms without), for no better words
    # on tests/turn_set.py's English turns (bench/pocketsphinx_finish.py). Off: the reply starts sooner.
    second_pass: bool = False
    # Decoders built at start-up and kept for the streams (voicebot/asr/pocketsphinx_decoders.py), split
    # among the processes (at least one each): a stream that finds one waiting builds nothing (a build
    # takes 0.2-0.6 s of CPU; on `processes: 0` it holds the server's GIL, and so the loop). 27 MB each
    # with a grammar, 90 MB with the general LM: 4 (360 MB with the LM) covers a show's host and guests
    # joining at once; raise it for a box that takes bursts of many streams (bench/soak.py: 10 at once).
    decoders: int = Field(4, ge=1)
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
    # The LM decode step as CUDA graphs per bucketed batch size (CUDA only).
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


class ClusterConfig(Section):
    """Several voicebot processes sharing conversations and channels through Redis (docs/deploy.md).

    No `redis_url`: one process keeps everything in itself, as before. A configured Redis that
    cannot be reached stops start-up; one lost later leaves the process working on its own
    (error events, voicebot_cluster_redis_up 0) until it is back.
    """

    redis_url: str | None = None  # e.g. redis://127.0.0.1:6379/0
    # Prefix of every key and pub/sub channel, so several shows can share one Redis (no glob
    # characters: servers subscribe to the pattern {prefix}ch:*).
    key_prefix: str = Field("voicebot:", pattern=r"^[A-Za-z0-9_.:-]+$")
    # A Redis call that takes longer counts as Redis lost. Redis on the same network answers in
    # well under 1 ms; this only has to outlast a stall of this server's own event loop.
    timeout_s: float = Field(2.0, gt=0)
    # A resumed conversation still held by a session on another server (its old socket not yet seen
    # closed, or that server draining) is waited for this long before the session starts without it.
    resume_wait_s: float = Field(3.0, ge=0)
    # While Redis is lost, a reconnection is tried this often.
    reconnect_interval_s: float = Field(1.0, gt=0)
    # A channel's owner key ({prefix}owner:NAME) expires this long after its server last renewed
    # it (every third of it, while the speaker is connected): a crashed server's channels are free
    # again after this long, and so are those of a server cut off from Redis for longer.
    channel_owner_ttl_s: float = Field(10.0, gt=0)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VOICEBOT_", env_nested_delimiter="__", extra="forbid")

    server: ServerConfig = ServerConfig()
    limits: LimitsConfig = LimitsConfig()
    gate: GateConfig = GateConfig()
    endpoint: EndpointConfig = EndpointConfig()
    pacing: PacingConfig = PacingConfig()
    reset: ResetConfig = ResetConfig()
    output: OutputConfig = OutputConfig()
    asr: AsrConfig = AsrConfig()
    tts: TtsConfig = TtsConfig()
    reply: ReplyConfig = ReplyConfig()
    cluster: ClusterConfig = ClusterConfig()
    log_level: str = "info"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first: it overrides the file's values, which arrive as init arguments.
        return env_settings, init_settings


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file and the offending keys."""


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Read the YAML file (or VOICEBOT_CONFIG, or configs/default.yaml) and apply env overrides."""
    path = Path(path or os.environ.get("VOICEBOT_CONFIG") or DEFAULT_CONFIG)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    _deep_update(data, overrides)
    try:
        return Settings(**data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid config {path}: {problems}") from exc


def _deep_update(base: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
