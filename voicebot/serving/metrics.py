"""Prometheus metrics of a device's scheduler, read from it at scrape time.

    register_scheduler_metrics(metrics.registry, synthesizer.scheduler)

adds, labelled by scheduler name:
- voicebot_scheduler_capacity_sessions: speaking sessions the measured step costs keep in real time;
- voicebot_scheduler_queue_depth: requests submitted and not yet answered;
- voicebot_scheduler_free_slots: LM KV slots free;
- voicebot_scheduler_decode_steps_total{batch_size}: LM decode steps run, by rows in the batch (the
  batch-size histogram);
- voicebot_scheduler_deadline_misses_total: chunks rendered after a listener that had audio ran out;
- voicebot_scheduler_refused_total: sessions refused by admission control;
- voicebot_scheduler_decode_step_seconds{batch_size}: the step cost admission uses (moving average).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
            ("voicebot_scheduler_deadline_misses", "Chunks rendered after a listener with audio ran out", s.deadline_misses),
            ("voicebot_scheduler_refused", "Sessions refused by admission control", s.refused),
        ]:
            family = CounterMetricFamily(metric, help_text, labels=["scheduler"])
            family.add_metric(name, value)
            yield family


def register_scheduler_metrics(registry: CollectorRegistry, scheduler: Scheduler) -> SchedulerCollector:
    collector = SchedulerCollector(scheduler)
    registry.register(collector)
    return collector
