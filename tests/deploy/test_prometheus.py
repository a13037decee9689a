"""deploy/grafana/'s dashboard against a real Prometheus (Debian's package, on 127.0.0.1, a temp dir,
a 1 s scrape) scraping the real server (the default config) while real WebSocket clients speak espeak
speech to it: every panel's every query is evaluated through Prometheus' HTTP API, is valid PromQL,
reads only metrics the server exports, and returns data.

One stated exception, whose queries must still be valid PromQL: DEVICE_ONLY, series a CPU server
with the default config has none of (no device scheduler, no GPU); their names are checked against
the collectors that export them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
import websockets
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import VoiceClient, free_port, make_settings, running_server, speech_pcm
from tests.deploy.test_manifests import DEPLOY, tool

DASHBOARD = DEPLOY / "grafana" / "voicebot-dashboard.json"
JOB = "voicebot"
SCRAPE_S = 1


def exported_names(exposition: str) -> set[str]:
    """Sample names an exposition declares (from its TYPE lines, with a histogram's _bucket)."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M):
        names |= {name, f"{name}_bucket", f"{name}_count", f"{name}_sum"} if kind == "histogram" else {name}
        if kind == "counter":
            names.add(f"{name}_total" if not name.endswith("_total") else name)
    return names


def scheduler_metric_names() -> set[str]:
    """The names voicebot/serving/metrics.py exports for a device scheduler, from its collector."""
    from voicebot.serving.metrics import register_scheduler_metrics

    scheduler = SimpleNamespace(name="lm", capacity=lambda: 4, pending=0, pool=SimpleNamespace(free=8),
                                batch_sizes={1: 3}, costs=SimpleNamespace(decode={1: 0.01}), renders=SimpleNamespace(deadline_misses=0, budget_deferrals=0),
                                refused=0, thread_faults=0)
    registry = CollectorRegistry()
    register_scheduler_metrics(registry, scheduler)
    return exported_names(generate_latest(registry).decode())


DEVICE_ONLY = scheduler_metric_names() | {"voicebot_gpu_memory_bytes"}


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target on the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def metrics_read(expr: str) -> set[str]:
    """The metrics a query reads (a histogram by its name, not its _bucket series)."""
    return {re.sub(r"_bucket$", "", name) for name in re.findall(r"([a-z_:][a-z0-9_:]*)\{job=\"\$job\"\}", expr)}


def as_prometheus_sees_it(expr: str, window: str) -> str:
    """The query Grafana would send, its variables filled in."""
    return expr.replace("$__rate_interval", window).replace("$job", JOB)


@contextlib.contextmanager
def prometheus_scraping(target_port: int, directory):
    port = free_port()
    config = directory / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
    }))
    log = open(directory / "prometheus.log", "wb")
    proc = subprocess.Popen([tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("prometheus did not start: " + (directory / "prometheus.log").read_text()[-2000:])
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(url: str, promql: str) -> dict:
    """One instant query; Prometheus answers 400 with errorType bad_data for invalid PromQL."""
    return httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10).json()


def wait_for(url: str, promql: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not query(url, promql)["data"]["result"]:
        assert time.monotonic() < deadline, f"Prometheus never had {promql}"
        time.sleep(0.5)


async def scripted_load(ws_url: str) -> None:
    """A short show: a question answered, a listener refused for a bad channel name."""

    async def question():
        async with VoiceClient.connect(ws_url) as client:
            await client.stream(speech_pcm("what time does the show start tomorrow"))
            await client.wait_for("audio.end")
            await client.wait_for("state.reset", timeout=30)  # the session stays for one (every 2 s, between turns)

    async def refused_listener():
        async with websockets.connect(f"{ws_url}?role=listener&channel=no!such!channel") as ws:
            assert json.loads(await ws.recv())["code"] == "invalid_message"

    await asyncio.gather(question(), refused_listener())


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """(Prometheus URL, the server's /metrics) after the scripted load, every sample of it scraped.
    Engine resets every 2 s, so a short run has some (the default is 30 minutes)."""
    with running_server(make_settings(reset={"interval_s": 2.0})) as server:
        with prometheus_scraping(server.settings.server.port, tmp_path_factory.mktemp("prometheus")) as url:
            wait_for(url, f'up{{job="{JOB}"}} == 1')
            asyncio.run(scripted_load(server.ws_url))
            wait_for(url, f'voicebot_resets_total{{job="{JOB}"}} > 0')
            sent = server.metric("voicebot_frames_sent_total")
            wait_for(url, f'voicebot_frames_sent_total{{job="{JOB}"}} >= {sent}')  # the load's last scrape is in
            yield url, server.get("/metrics").text


def test_every_panel_query_is_valid_promql_and_returns_data(scraped):
    url, _ = scraped
    window = "2m"  # longer than the whole run: every rate() sees the load
    empty = []
    for title, expr in panel_queries():
        answer = query(url, as_prometheus_sees_it(expr, window))
        assert answer["status"] == "success", f"{title}: {expr}: {answer.get('error')}"
        exempt = metrics_read(expr) and metrics_read(expr) <= DEVICE_ONLY
        if not answer["data"]["result"] and not exempt:
            empty.append(f"{title}: {expr}")
    assert not empty, "queries with no data:\n" + "\n".join(empty)


def test_the_panels_read_only_metrics_the_server_exports(scraped):
    _, exposition = scraped
    exported = exported_names(exposition) | DEVICE_ONLY
    read = set().union(*(metrics_read(expr) for _, expr in panel_queries()))
    assert read <= exported, f"panels read metrics the server does not export: {read - exported}"


def test_the_load_shows_on_the_dashboard(scraped):
    """The figures an operator reads at 3 a.m. are the load's: a refusal, first-audio latency, resets, RSS."""
    url, _ = scraped

    def values(promql: str) -> dict[str, float]:
        return {json.dumps(r["metric"]): float(r["value"][1]) for r in query(url, as_prometheus_sees_it(promql, "2m"))["data"]["result"]}

    assert values(f'sum by (reason) (increase(voicebot_sessions_refused_total{{job="{JOB}"}}[2m]))')  # the bad channel name
    assert sum(values(f'increase(voicebot_resets_total{{job="{JOB}"}}[2m])').values()) > 0
    [p95] = values('histogram_quantile(0.95, sum by (le) (rate(voicebot_first_audio_seconds_bucket{job="$job"}[2m])))').values()
    assert 0 < p95 < float("inf")
    [rss] = values('sum(process_resident_memory_bytes{job="$job"})').values()
    assert rss > 10e6


def test_the_generator_wrote_the_committed_dashboard():
    made = subprocess.run([sys.executable, "-c", "import json, make_dashboard; print(json.dumps(make_dashboard.dashboard()))"],
                          cwd=DEPLOY / "grafana", capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(DASHBOARD.read_text()) == json.loads(made.stdout), "run python deploy/grafana/make_dashboard.py"


def test_a_broken_query_is_answered_as_an_error(scraped):
    """The check above can fail: Prometheus answers invalid PromQL with an error, not an empty result."""
    url, _ = scraped
    answer = query(url, as_prometheus_sees_it('sum by (le) (rate(voicebot_first_audio_seconds_bucket{job="$job"}[$__rate_interval])', "2m"))
    assert answer["status"] == "error" and answer["errorType"] == "bad_data"


def test_the_gpu_memory_panel_reads_what_pytorch_reports(monkeypatch):
    """voicebot_gpu_memory_bytes, DEVICE_ONLY above, from a CUDA PyTorch (faked here: no GPU on the test machine)."""
    from voicebot.metrics import Metrics

    reported = {"allocated": [3 << 30, 1 << 30], "reserved": [4 << 30, 2 << 30]}
    cuda = SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 2,
                           memory_allocated=lambda d: reported["allocated"][d], memory_reserved=lambda d: reported["reserved"][d])
    exposition = generate_latest(Metrics().registry).decode()
    assert "voicebot_gpu_memory_bytes{" not in exposition  # torch not imported, or no CUDA: no samples
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    [family] = [f for f in text_string_to_metric_families(generate_latest(Metrics().registry).decode())
                if f.name == "voicebot_gpu_memory_bytes"]
    assert {(s.labels["device"], s.labels["kind"]): s.value for s in family.samples} == {
        (str(device), kind): value for kind, values in reported.items() for device, value in enumerate(values)}
