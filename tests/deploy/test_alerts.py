"""deploy/prometheus/ checked with Debian's promtool: the alert rules parse (`check rules`), each
alert fires on its failure and stays quiet on a healthy server (`test rules`, its unit tests), and
every metric an alert reads is one the server exports (or one of the allowed exceptions below)."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.deploy.test_manifests import DEPLOY, tool
from tests.deploy.test_prometheus import exported_names

RULES = DEPLOY / "prometheus" / "voicebot-alerts.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "voicebot-alerts.test.yaml"
SHOW_ALERTS = {"VoicebotDown", "VoicebotFirstAudioSlow", "VoicebotRefusalsClimbing", "VoicebotEngineFailures",
               "VoicebotEngineFailing", "VoicebotResetSlow", "VoicebotMemoryGrowing", "VoicebotDecoderProcessLost"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent)


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_the_rules_pass_promtool_check():
    checked = promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_promtool_check_rejects_a_broken_rule(tmp_path):
    broken = yaml.safe_load(RULES.read_text())
    broken["groups"][0]["rules"][1]["expr"] = "histogram_quantile(0.95, sum by (le) (rate(voicebot_first_audio_seconds_bucket[5m]))"
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    checked = promtool("check", "rules", str(tmp_path / "broken.yaml"))
    assert checked.returncode != 0 and "parse error" in checked.stdout + checked.stderr


def test_every_alert_passes_its_unit_tests():
    tested = promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_has_a_unit_test_that_sees_it_fire():
    fired = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        fired |= {check["alertname"] for check in case["alert_rule_test"] if check["exp_alerts"]}
    assert {rule["alert"] for rule in rules()} == SHOW_ALERTS == fired


def test_the_alerts_read_metrics_the_server_exports():
    from voicebot.metrics import Metrics
    from prometheus_client import generate_latest

    exported = exported_names(generate_latest(Metrics().registry).decode())
    # Read at scrape time from engines the bare Metrics does not have: the decoding processes'
    # counter is pocketsphinx's (checked against the running server in test_prometheus.py), up is Prometheus'.
    not_in_bare_registry = {"up", "voicebot_decoder_processes_lost_total"}
    for rule in rules():
        for name in set(re.findall(r"\b((?:voicebot|process)_[a-z_]+|up)\b", rule["expr"])):
            assert name in exported | not_in_bare_registry, f"{rule['alert']} reads {name}, which nothing exports"
