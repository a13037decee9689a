"""Writes voicebot-dashboard.json, the Grafana dashboard of a live show: `python deploy/grafana/make_dashboard.py`.

The panels are data here (title, unit, queries), the layout and Grafana's JSON shape are made below;
edit this file, run it, commit both. tests/deploy/test_prometheus.py runs every query against a
real Prometheus scraping a real server. Queries use two dashboard variables: $datasource (a
Prometheus) and $job (the scrape job of the voicebot servers, `voicebot` by default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).with_name("voicebot-dashboard.json")
J = '{job="$job"}'  # every series is voicebot's own: filtered by the scrape job
RATE = "$__rate_interval"


def quantile(q: float, histogram: str, by: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le{by}) (rate({histogram}_bucket{J}[{RATE}])))"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    no_value: str = "0"  # what Grafana shows when no query has a series: a count's 0, or why a latency has none


# Rows of panels, side by side, for what an operator asks at 3 a.m.
ROWS: list[tuple[str, list[Panel]]] = [
    ("Sessions", [
        Panel("Live sessions and listeners", "Speaking sessions connected now (each a speaker: a browser, an OBS source, "
              "a /v1/realtime client) and read-only channel listeners (overlays).", "short", [
            (f"sum by (instance) (voicebot_active_sessions{J})", "sessions {{instance}}"),
            (f"sum by (instance) (voicebot_active_listeners{J})", "listeners {{instance}}"),
        ]),
        Panel("Sessions admitted vs refused", "Sessions started and refused per minute; refused by reason "
              "(busy: a limit or capacity; unauthorized: a wrong token; shutting_down; invalid_message).", "short", [
            (f"sum(rate(voicebot_sessions_total{J}[{RATE}])) * 60", "admitted / min"),
            (f"sum by (reason) (rate(voicebot_sessions_refused_total{J}[{RATE}])) * 60 or on() vector(0)", "refused / min {{reason}}"),
        ]),
        Panel("Per-pool load", "Share of each engine thread pool's (or decoding process's) time spent working, "
              "last 5 s: admission refuses sessions before one reaches 1.", "percentunit", [
            (f"max by (worker) (voicebot_worker_load{J})", "{{worker}}"),
        ]),
    ]),
    ("Latency", [
        Panel("End of speech to first audio", "What a listener waits: the end of their speech (VAD) to the first reply "
              "frame sent. The VoicebotFirstAudioSlow alert fires at p95 over 2 s for 5 minutes.", "s", [
            (quantile(0.5, "voicebot_first_audio_seconds"), "p50"),
            (quantile(0.95, "voicebot_first_audio_seconds"), "p95"),
        ], no_value="no replies"),
        Panel("Input lag", "How far behind real time the server hears a session's audio.", "s", [
            (quantile(0.5, "voicebot_input_lag_seconds"), "p50"),
            (quantile(0.95, "voicebot_input_lag_seconds"), "p95"),
        ], no_value="no input"),
        Panel("Event loop lag", "How late the event loop runs a timer, p99: every session's audio waits on it.", "s", [
            (quantile(0.99, "voicebot_event_loop_lag_seconds"), "lag p99"),
        ]),
        Panel("Event loop stalls", "Ticks over 100 ms late per minute, by what held the loop (gc; gil: another "
              "thread kept the GIL; callback: a slow call on the loop, named in the log).", "short", [
            (f"sum by (cause) (rate(voicebot_event_loop_stalls_total{J}[{RATE}])) * 60", "{{cause}}"),
        ]),
    ]),
    ("Turns and replies", [
        Panel("Turn decisions by cause", "Turns ended per minute, by what decided it (smart: the end-of-turn model; "
              "silence; input.end).", "short", [
            (f"sum by (by) (rate(voicebot_turn_ends_total{J}[{RATE}])) * 60 or on() vector(0)", "{{by}}"),
        ]),
        Panel("Barge-ins", "Replies stopped while playing, per minute, by reason (barge_in: a user spoke over the bot).", "short", [
            (f"sum by (reason) (rate(voicebot_replies_interrupted_total{J}[{RATE}])) * 60", "{{reason}}"),
        ]),
        Panel("Underruns and dropped audio", "Reply frames sent late (underruns) and reply frames not sent, per minute "
              "by reason (overload must stay 0); input audio dropped, seconds per minute by reason.", "short", [
            (f"sum(rate(voicebot_underruns_total{J}[{RATE}])) * 60", "underruns / min"),
            (f"sum by (reason) (rate(voicebot_frames_dropped_total{J}[{RATE}])) * 60", "frames dropped / min {{reason}}"),
            (f"sum by (reason) (rate(voicebot_input_dropped_seconds_total{J}[{RATE}])) * 60 or on() vector(0)",
             "input dropped s / min {{reason}}"),
        ]),
        Panel("Pauses held over echo", "How much later an utterance ended because the echo canceller's suppressor "
              "hid windows after its last word (not counted as the user's silence; at most half of "
              "endpoint_silence_ms a pause), p50 and p95: the price of keeping words said over the bot's echo.", "s", [
            (quantile(0.5, "voicebot_endpoint_held_seconds"), "p50"),
            (quantile(0.95, "voicebot_endpoint_held_seconds"), "p95"),
        ], no_value="no echo cancellation"),
    ]),
    ("Engines", [
        Panel("Engine errors by engine", "Engine calls that failed in a session per minute (each costs a turn), and "
              "responder errors by kind.", "short", [
            (f"sum by (engine) (rate(voicebot_engine_failures_total{J}[{RATE}])) * 60", "{{engine}}"),
            (f"sum by (kind) (rate(voicebot_reply_errors_total{J}[{RATE}])) * 60", "responder {{kind}}"),
            (f"sum by (engine, cause) (increase(voicebot_decoder_processes_lost_total{J}[{RATE}])) or on() vector(0)",
             "decoding process lost {{engine}} {{cause}}"),
        ]),
        Panel("Resets", "Periodic engine-state resets per minute, and engines whose reset could not rebuild "
              "their state (kept it), by engine.", "short", [
            (f"sum(rate(voicebot_resets_total{J}[{RATE}])) * 60", "resets / min"),
            (f"sum by (engine) (rate(voicebot_resets_skipped_total{J}[{RATE}])) * 60 or on() vector(0)", "skipped / min {{engine}}"),
        ]),
        Panel("Reset duration", "How long a periodic reset holds a session at a turn boundary, p95; "
              "VoicebotResetSlow fires over 0.5 s.", "s", [
            (quantile(0.95, "voicebot_reset_duration_seconds"), "p95"),
        ], no_value="no resets"),
        Panel("Batch sizes", "Rows per call of the batched engines: the VAD batcher's onnxruntime calls and, with a "
              "device scheduler (CosyVoice 2), its LM decode steps; per second, by batch size.", "short", [
            (f"sum by (batch_size) (rate(voicebot_vad_calls_total{J}[{RATE}]))", "VAD rows={{batch_size}}"),
            (f"sum by (batch_size) (rate(voicebot_scheduler_decode_steps_total{J}[{RATE}]))", "LM decode rows={{batch_size}}"),
        ], no_value="no device scheduler"),
    ]),
    ("Device and process", [
        Panel("Scheduler deadline misses and queue", "Chunks rendered after a listener had run out of audio (per "
              "minute), and requests waiting on the device scheduler. Only with a device scheduler (CosyVoice 2).", "short", [
            (f"sum by (scheduler) (rate(voicebot_scheduler_deadline_misses_total{J}[{RATE}])) * 60", "deadline misses / min {{scheduler}}"),
            (f"sum by (scheduler) (voicebot_scheduler_queue_depth{J})", "queue {{scheduler}}"),
        ], no_value="no device scheduler"),
        Panel("GPU memory", "CUDA memory this server's PyTorch holds, by device: allocated in tensors and reserved by "
              "its caching allocator. Empty on a CPU-only server.", "bytes", [
            (f"sum by (instance, device, kind) (voicebot_gpu_memory_bytes{J})", "{{instance}} cuda:{{device}} {{kind}}"),
        ], no_value="no GPU"),
        Panel("Process RSS", "Resident memory of each server, and its growth per hour over the last hour; "
              "VoicebotMemoryGrowing fires over 100 MiB an hour for 2 hours.", "bytes", [
            (f"sum by (instance) (process_resident_memory_bytes{J})", "RSS {{instance}}"),
            (f"sum by (instance) (deriv(process_resident_memory_bytes{J}[1h])) * 3600", "growth / hour {{instance}}"),
        ]),
    ]),
]


def dashboard() -> dict:
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels, y, next_id = [], 0, 1
    for row_title, row in ROWS:
        panels.append({"type": "row", "title": row_title, "id": next_id, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        next_id, y = next_id + 1, y + 1
        width = 24 // len(row)
        for i, panel in enumerate(row):
            panels.append({
                "type": "timeseries", "title": panel.title, "description": panel.description, "id": next_id,
                "datasource": datasource,
                "gridPos": {"h": 8, "w": width, "x": width * i, "y": y},
                "fieldConfig": {"defaults": {"unit": panel.unit, "noValue": panel.no_value, "min": 0}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}},
                "targets": [{"datasource": datasource, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + k)}
                            for k, (expr, legend) in enumerate(panel.targets)],
            })
            next_id += 1
        y += 8
    return {
        "title": "voicebot: live show", "uid": "voicebot-show", "tags": ["voicebot"], "editable": True,
        "schemaVersion": 39, "refresh": "30s", "time": {"from": "now-3h", "to": "now"}, "timezone": "browser",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            {"name": "job", "label": "Scrape job", "type": "custom", "query": "voicebot",
             "current": {"text": "voicebot", "value": "voicebot"},
             "options": [{"text": "voicebot", "value": "voicebot", "selected": True}]},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")
