"""Prometheus metrics, all named voicebot_*, served at /metrics.

Latency histograms are in seconds. `voicebot_first_audio_seconds` is measured from the VAD's end of
speech (the end of the last voiced window) to the first reply frame sent: what the user waits.
"""

from __future__ import annotations

from collections.abc import Callable

import sys

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# voicebot.reply.base.ResponderError kinds, exported as 0 from the start so alerts can rate() them.
REPLY_ERROR_KINDS = ("connect", "status", "server_error", "first_token_timeout", "idle_timeout", "total_timeout", "dropped",
                     "malformed", "internal")
# (engine, stage) of voicebot_engine_failures_total, exported as 0 from the start.
ENGINE_FAILURES = (("asr", "feed"), ("asr", "finish"), ("vad", "chunk"), ("responder", "stream"), ("tts", "synthesis"))
LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class Metrics:
    """One registry per app, so tests can run several apps in one process."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.active_sessions = Gauge("voicebot_active_sessions", "Sessions connected now", registry=r)
        self.worker_load = Gauge("voicebot_worker_load", "Share of an engine thread pool's time spent running calls (last 5 s)", ["worker"], registry=r)
        self.active_listeners = Gauge("voicebot_active_listeners", "Listener connections now", registry=r)
        self.listeners_dropped = Counter("voicebot_listeners_dropped_total", "Listeners dropped, by reason (fell_behind: its queue was full; stalled: its socket took no message for a while)", ["reason"], registry=r)
        for reason in ("fell_behind", "stalled"):  # voicebot.channels.DROPPED_BECAUSE
            self.listeners_dropped.labels(reason)
        self.obs_bad_chunks = Counter("voicebot_obs_bad_chunks_total", "Messages on /obs/audio that could not be used, by reason", ["reason"], registry=r)
        self.sessions_total = Counter("voicebot_sessions_total", "Sessions started", registry=r)
        self.sessions_refused = Counter("voicebot_sessions_refused_total", "Sessions refused, by cause (input_lag, input_lag_forecast, pool_load, cold_start, max_sessions, per_client, synthesizer; else the error code: unauthorized, shutting_down, ...)", ["reason"], registry=r)
        # Per chunk of input, once the front end, the VAD, the endpoint rule and the recognizer's feed
        # are done with it: how long after its arrival (voicebot/serving/capacity.py, InputLag).
        self.input_lag = Histogram("voicebot_input_lag_seconds", "Input chunk arrival to processed (front end, VAD, endpoint, recognizer feed), by the decoding pool of its session",
                                   ["pool"], buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0), registry=r)
        self.input_deadline_misses = Counter("voicebot_input_deadline_misses_total", "Input chunks processed later than limits.max_input_lag_s after they arrived, by pool", ["pool"], registry=r)
        # The input path's cost: voicebot_input_cpu_seconds_total (register_input_cpu) over this.
        self.input_audio = Counter("voicebot_input_audio_seconds_total", "Input audio processed by the sessions' input path", registry=r)
        self.utterances = Counter("voicebot_utterances_total", "Final transcripts, by the model that produced the text used", ["model"], registry=r)
        self.dialect_fallbacks = Counter("voicebot_dialect_fallbacks_total", "Utterances re-decoded by the fallback model", ["used"], registry=r)
        self.asr_confidence = Histogram("voicebot_asr_confidence", "Final transcript confidence", ["model"], buckets=(0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0), registry=r)
        self.first_audio = Histogram("voicebot_first_audio_seconds", "End of speech (VAD) to first reply frame sent", buckets=LATENCY_BUCKETS, registry=r)
        self.endpoint_delay = Histogram("voicebot_endpoint_delay_seconds", "End of speech to endpoint decision", buckets=LATENCY_BUCKETS, registry=r)
        self.asr_final = Histogram("voicebot_asr_final_seconds", "Endpoint decision to final transcript", buckets=LATENCY_BUCKETS, registry=r)
        self.reply_first_text = Histogram("voicebot_reply_first_text_seconds", "Reply request to first text delta", buckets=LATENCY_BUCKETS, registry=r)
        self.reply_total = Histogram("voicebot_reply_total_seconds", "Reply request to last text delta, replies the responder finished", buckets=LATENCY_BUCKETS, registry=r)
        self.reply_errors = Counter("voicebot_reply_errors_total", "Responder failures, by kind", ["kind"], registry=r)
        self.tts_first_audio = Histogram("voicebot_tts_first_audio_seconds", "First reply text to first synthesized audio", buckets=LATENCY_BUCKETS, registry=r)
        self.frames_sent = Counter("voicebot_frames_sent_total", "Reply audio frames sent", registry=r)
        self.frames_dropped = Counter("voicebot_frames_dropped_total", "Reply audio frames not sent, by reason (interrupted, client_gone, overload, preemptive: a prepared reply discarded)", ["reason"], registry=r)
        self.replies_interrupted = Counter("voicebot_replies_interrupted_total", "Replies stopped while playing, by reason (barge_in: the user spoke over the bot; client: reply.cancel; say: a say message)", ["reason"], registry=r)
        self.replies_interrupted.labels("barge_in")
        self.underruns = Counter("voicebot_underruns_total", "Reply frames sent after the client should already have played them", registry=r)
        self.gate_muted = Counter("voicebot_gate_muted_seconds_total", "Input audio muted by the noise gate", registry=r)
        self.input_dropped = Counter("voicebot_input_dropped_seconds_total", "Input audio dropped, by reason", ["reason"], registry=r)
        self.resets = Counter("voicebot_resets_total", "Periodic state resets that renewed engine state (a state.reset sent)", registry=r)
        self.resets_skipped = Counter("voicebot_resets_skipped_total", "Engine resets in a periodic reset that could not rebuild their state (it was kept), by engine", ["engine"], registry=r)
        self.reset_duration = Histogram("voicebot_reset_duration_seconds", "Time to drop and rebuild engine state", buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5), registry=r)
        self.errors = Counter("voicebot_errors_total", "Error events sent, by code", ["code"], registry=r)
        self.asyncio_tasks = Gauge("voicebot_asyncio_tasks", "Tasks on the event loop (sampled with the loop lag)", registry=r)
        self.turn_ends = Counter("voicebot_turn_ends_total", "Turns ended, by what decided it (smart, silence, input.end)", ["by"], registry=r)
        self.smart_turn = Histogram("voicebot_smart_turn_seconds", "Pause heard to the end-of-turn model's answer", buckets=LATENCY_BUCKETS, registry=r)
        self.preemptive = Counter("voicebot_preemptive_total", "Replies prepared during a pause, by outcome (kept, user_went_on, changed, superseded, session_closed)", ["outcome"], registry=r)
        self.echo_attenuation = Histogram("voicebot_echo_attenuation_db", "Input over output energy of the echo canceller while the bot spoke, per session", buckets=(0, 3, 6, 10, 15, 20, 30, 40, 60), registry=r)
        # At most HELD_SILENCE_SHARE of endpoint_silence_ms (voicebot/audio/endpoint.py): 224 ms at the default 500.
        self.endpoint_held = Histogram("voicebot_endpoint_held_seconds", "How much later an utterance ended than its silence alone would have ended it, the windows the echo canceller's suppressor hid after its last word not counted as silence (VadEvent.held_ms), per utterance of a session with echo cancellation",
                                       buckets=(0, 0.032, 0.064, 0.128, 0.192, 0.256, 0.5, 1.0), registry=r)
        self.audio_api_requests = Counter("voicebot_audio_api_requests_total", "Requests to /v1/audio/speech and /v1/audio/transcriptions, by route and outcome (ok, or the error code)", ["route", "outcome"], registry=r)
        self.audio_api_seconds = Counter("voicebot_audio_api_audio_seconds_total", "Audio synthesized by /v1/audio/speech or uploaded to /v1/audio/transcriptions, in seconds", ["route"], registry=r)
        self.audio_api_active = Gauge("voicebot_audio_api_active", "/v1/audio/* requests running now (they count toward server.max_sessions)", registry=r)
        # Buckets up to 5 s: a soak's worst ticks (0.25-1 s and more on a loaded box) must not all land in +Inf.
        self.loop_lag = Histogram("voicebot_event_loop_lag_seconds", "How late the event loop runs a timer (voicebot/loop_watch.py)",
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2, 5), registry=r)
        self.loop_stalls = Counter("voicebot_event_loop_stalls_total", "Event loop ticks over 100 ms late, by what held the loop (gc, gil: another thread kept the GIL, callback: a slow call on the loop)", ["cause"], registry=r)
        self.gc_pause = Histogram("voicebot_gc_pause_seconds", "Python cyclic garbage collections, by generation: each holds every thread, the loop's too", ["generation"],
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=r)
        self.engine_failures = Counter("voicebot_engine_failures_total", "Engine calls that failed in a session, by engine (asr, vad, responder, tts) and stage (feed, finish, chunk, stream, synthesis)", ["engine", "stage"], registry=r)
        self.engine_overloads = Counter("voicebot_engine_overloads_total", "Input an engine had no room for in a session (answered busy, not an engine failure), by engine (vad)", ["engine"], registry=r)
        self.engine_overloads.labels("vad")
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...: the RSS alert's
        r.register(_GpuMemory())
        for engine, stage in ENGINE_FAILURES:
            self.engine_failures.labels(engine, stage)
        for kind in REPLY_ERROR_KINDS:
            self.reply_errors.labels(kind)
        for outcome in ("kept", "user_went_on", "changed"):
            self.preemptive.labels(outcome)
        for cause in ("gc", "gil", "callback"):
            self.loop_stalls.labels(cause)
        for generation in "012":
            self.gc_pause.labels(generation)
        for reason in ("interrupted", "client_gone", "overload", "preemptive"):
            self.frames_dropped.labels(reason)  # exported as 0 from the start: overload must stay 0

    def watch_workers(self, workers) -> None:
        """Export voicebot_worker_threads_lost_total for these voicebot.serving.worker.Workers."""
        self.registry.register(_ThreadsLost(workers))


class _GpuMemory(Collector):
    """voicebot_gpu_memory_bytes{device,kind}: what this process's PyTorch holds on each CUDA device
    (allocated: in tensors; reserved: by its caching allocator), read at scrape time. No samples in a
    server that never imported torch (the default config's) or has no CUDA device."""

    def collect(self):
        family = GaugeMetricFamily("voicebot_gpu_memory_bytes", "CUDA memory held by this process's PyTorch, by device and kind "
                                   "(allocated: in tensors; reserved: by the caching allocator)", labels=["device", "kind"])
        torch = sys.modules.get("torch")  # never imported here: only read when an engine loaded it
        if torch is not None and torch.cuda.is_initialized():
            for device in range(torch.cuda.device_count()):
                family.add_metric([str(device), "allocated"], torch.cuda.memory_allocated(device))
                family.add_metric([str(device), "reserved"], torch.cuda.memory_reserved(device))
        yield family


class _ThreadsLost(Collector):
    """Worker threads that died (and were replaced), read from the workers at scrape time."""

    def __init__(self, workers) -> None:
        self.workers = list(workers)

    def collect(self):
        family = CounterMetricFamily("voicebot_worker_threads_lost", "Engine worker threads that died and were replaced", labels=["worker"])
        for worker in self.workers:
            family.add_metric([worker.name], worker.threads_lost)
        yield family


def register_voice_refreshes(registry: CollectorRegistry, failed: Callable[[], int]) -> None:
    """Export voicebot_voice_refreshes_failed_total: a synthesizer's voice derivations that failed
    (each skips the resets that shared it), read at scrape time, as /readyz's voice_refreshes_failed."""
    registry.register(_VoiceRefreshesFailed(failed))


class _VoiceRefreshesFailed(Collector):
    def __init__(self, failed: Callable[[], int]) -> None:
        self.failed = failed

    def collect(self):
        family = CounterMetricFamily("voicebot_voice_refreshes_failed", "Voice state derivations (periodic reset) that failed; the voice kept its state")
        family.add_metric([], self.failed())
        yield family


def register_processes_lost(registry: CollectorRegistry, engine: str, lost: Callable[[], dict[str, int]]) -> None:
    """Export voicebot_decoder_processes_lost_total{engine,cause}: an engine's decoding processes
    that died or hung (no answer by a request's deadline; killed) and were replaced, by cause, read
    at scrape time, as /readyz's processes_lost."""
    registry.register(_ProcessesLost(engine, lost))


class _ProcessesLost(Collector):
    def __init__(self, engine: str, lost: Callable[[], dict[str, int]]) -> None:
        self.engine = engine
        self.lost = lost

    def collect(self):
        family = CounterMetricFamily("voicebot_decoder_processes_lost", "Decoding processes lost and replaced, by engine and cause "
                                     "(died; hung: no answer by its request's deadline, killed); their streams lost their utterance in progress",
                                     labels=["engine", "cause"])
        for cause, count in self.lost().items():
            family.add_metric([self.engine, cause], count)
        yield family


def register_input_cpu(registry: CollectorRegistry, stages: Callable[[], dict[str, float]]) -> None:
    """Export voicebot_input_cpu_seconds_total{stage}: the CPU seconds the input path's pools spent
    (front_end: the input clock's resampler, echo canceller and gate; vad; asr: the recognizer's
    pools, finishes included), read at scrape time; over voicebot_input_audio_seconds_total, the
    input path's cost per second of audio."""
    registry.register(_InputCpu(stages))


class _InputCpu(Collector):
    def __init__(self, stages: Callable[[], dict[str, float]]) -> None:
        self.stages = stages

    def collect(self):
        family = CounterMetricFamily("voicebot_input_cpu_seconds", "CPU seconds of the input path's pools, by stage "
                                     "(front_end, vad, asr)", labels=["stage"])
        for stage, seconds in self.stages().items():
            family.add_metric([stage], seconds)
        yield family
