"""The periodic reset stage alone: it reports what was renewed, and an engine that kept its old
state (a CosyVoice 2 voice derivation that failed) is named apart, never reported or counted as reset."""

from __future__ import annotations

import asyncio

from voicebot.engine_reports import ResetReport
from voicebot.frontends.voice import payload
from voicebot.metrics import Metrics
from voicebot.session.outbox import Outbox
from voicebot.session.reset import EngineReset


class Engine:
    """An engine whose reset renews its state, or keeps it (`skips`)."""

    def __init__(self, name: str, skips: bool) -> None:
        self.name, self.skips, self.generation = name, skips, 0

    async def reset(self) -> ResetReport:
        if self.skips:
            return ResetReport(self.name, self.generation, 0, skipped=True)
        self.generation += 1
        return ResetReport(self.name, self.generation, 100)


def run_reset(*engines: Engine) -> tuple[list[dict], Metrics, EngineReset]:
    metrics = Metrics()

    async def scenario():
        outbox = Outbox(metrics)
        reset = EngineReset(60.0, *engines, metrics, outbox)
        await reset.run("periodic")
        sent = []
        while not outbox.empty():
            sent.append(payload(await outbox.get()))  # as /v1/voice writes it
        return sent, reset

    sent, reset = asyncio.run(scenario())
    return sent, metrics, reset


def sample(metrics: Metrics, name: str, labels: dict | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_a_skipped_engine_is_named_apart_and_the_others_are_reported_reset():
    sent, metrics, reset = run_reset(Engine("pocketsphinx", skips=False), Engine("cosyvoice2", skips=True))
    assert len(sent) == 1 and sent[0]["type"] == "state.reset"
    assert sent[0]["engines"] == [{"engine": "pocketsphinx", "generation": 1, "bytes_freed": 100}]
    assert sent[0]["skipped"] == ["cosyvoice2"]
    assert sample(metrics, "voicebot_resets_total") == 1 and reset.count == 1
    assert sample(metrics, "voicebot_resets_skipped_total", {"engine": "cosyvoice2"}) == 1


def test_a_reset_that_renewed_nothing_is_not_a_reset():
    sent, metrics, reset = run_reset(Engine("pocketsphinx", skips=True), Engine("cosyvoice2", skips=True))
    assert sent == []
    assert sample(metrics, "voicebot_resets_total") == 0 and reset.count == 0
    assert sample(metrics, "voicebot_resets_skipped_total", {"engine": "cosyvoice2"}) == 1
    assert not reset.due  # tried again at the next interval, not at once


def test_a_full_reset_names_nothing_skipped():
    sent, metrics, _ = run_reset(Engine("pocketsphinx", skips=False), Engine("espeak", skips=False))
    assert [e["engine"] for e in sent[0]["engines"]] == ["pocketsphinx", "espeak"] and sent[0]["skipped"] == []
    assert sample(metrics, "voicebot_resets_total") == 1
