"""Prometheus metrics of a device's scheduler, read from it at scrape time.

    register_scheduler_metrics(metrics.registry, synthesizer.scheduler)

adds, labelled by scheduler name:
- voicebot_scheduler_capacity_sessions: speaking sessions the measured step costs keep in real time;
- voicebot_scheduler_queue_depth: requests submitted and not yet answered;
- voicebot_scheduler_free_slots: LM KV slots free;
- voicebot_scheduler_decode_steps_total{batch_size}: LM decode steps run, by rows in the batch (the
  batch-size histogram);
- voicebot_scheduler_deadline_misses_total: chunks rendered after a listener that had audio ran out;
- voicebot_scheduler_render_deferrals_total: chunks a render call left to the next one by its audio
  budget (voicebot/serving/render_queue.py; none is dropped);
- voicebot_scheduler_refused_total: sessions refused by admission control;
- voicebot_scheduler_thread_faults_total: faults the scheduler's thread survived (a BaseException that
  is not an Exception raised in a step or call, or anything that broke its loop), each failing the
  requests it hit;
- voicebot_scheduler_decode_step_seconds{batch_size}: the step cost admission uses (moving average).

    register_vad_metrics(metrics.registry, runtime.vad, runtime.input_clock)

adds Silero's, from the two threads that call it (the input clock, voicebot/serving/input_clock.py,
for the live sessions; the VAD batcher, voicebot/serving/vad.py, for /funasr's segmenter and the
transcription endpoint), summed:
- voicebot_vad_queue_depth: streams with windows waiting or being judged;
- voicebot_vad_calls_total{batch_size}: onnxruntime calls run, by rows in the call;
- voicebot_vad_thread_faults_total: faults their threads survived, as the scheduler's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from voicebot.serving.input_clock import InputClock
from voicebot.serving.vad import VadBatcher

if TYPE_CHECKING:  # a type only: the default config's server never imports torch for its VAD metrics
    from voicebot.serving.scheduler import Scheduler


class SchedulerCollector(Collector):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        s, name = self.scheduler, [self.scheduler.name]
        capacity = s.capacity()
        for metric, help_text, value in [
            ("voicebot_scheduler_capacity_sessions", "Speaking sessions kept in real time at the measured step costs",
             -1 if capacity is None else capacity),
            ("voicebot_scheduler_queue_depth", "Scheduler requests submitted and not yet answered", s.pending),
            ("voicebot_scheduler_free_slots", "LM KV cache slots free", s.pool.free),
        ]:
            family = GaugeMetricFamily(metric, help_text, labels=["scheduler"])
            family.add_metric(name, value)
            yield family
        steps = CounterMetricFamily("voicebot_scheduler_decode_steps", "LM decode steps run, by batch size",
                                    labels=["scheduler", "batch_size"])
        cost = GaugeMetricFamily("voicebot_scheduler_decode_step_seconds", "LM decode step cost (moving average)",
                                 labels=["scheduler", "batch_size"])
        for batch, count in sorted(s.batch_sizes.items()):
            steps.add_metric([*name, str(batch)], count)
        for batch, seconds in sorted(s.costs.decode.items()):
            cost.add_metric([*name, str(batch)], seconds)
        yield steps
        yield cost
        for metric, help_text, value in [
            ("voicebot_scheduler_deadline_misses", "Chunks rendered after a listener with audio ran out", s.renders.deadline_misses),
            ("voicebot_scheduler_render_deferrals", "Chunks a render call left to the next by its audio budget (none dropped)",
             s.renders.budget_deferrals),
            ("voicebot_scheduler_refused", "Sessions refused by admission control", s.refused),
            ("voicebot_scheduler_thread_faults", ("Faults survived by the scheduler thread (BaseExceptions raised "
                                                  "in it, breaks of its loop), each failing the requests it hit"),
             s.thread_faults),
        ]:
            family = CounterMetricFamily(metric, help_text, labels=["scheduler"])
            family.add_metric(name, value)
            yield family


def register_scheduler_metrics(registry: CollectorRegistry, scheduler: Scheduler) -> SchedulerCollector:
    collector = SchedulerCollector(scheduler)
    registry.register(collector)
    return collector


class VadCollector(Collector):
    def __init__(self, callers: tuple[VadBatcher | InputClock, ...]) -> None:
        self.callers = callers

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("voicebot_vad_queue_depth", "Streams with VAD windows waiting or being judged")
        depth.add_metric([], sum(c.pending for c in self.callers))
        yield depth
        calls = CounterMetricFamily("voicebot_vad_calls", "Silero VAD onnxruntime calls run, by rows in the call",
                                    labels=["batch_size"])
        for batch, count in sorted(sum((Counter(c.batch_sizes) for c in self.callers), Counter()).items()):
            calls.add_metric([str(batch)], count)
        yield calls
        faults = CounterMetricFamily("voicebot_vad_thread_faults", "Faults survived by the threads that call Silero (the "
                                     "input clock's, the VAD batcher's): BaseExceptions raised in them, breaks of their "
                                     "loops, each failing the requests it hit")
        faults.add_metric([], sum(c.thread_faults for c in self.callers))
        yield faults


def register_vad_metrics(registry: CollectorRegistry, *callers: VadBatcher | InputClock) -> VadCollector:
    collector = VadCollector(callers)
    registry.register(collector)
    return collector
