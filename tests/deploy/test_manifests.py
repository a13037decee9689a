"""deploy/ checked offline: Kubernetes schemas, yamllint, hadolint on the Dockerfiles, haproxy -c,
and the few facts the manifests must agree on with the server (ports, probes, grace period, metric)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from voicebot.config import load_settings
from voicebot.config.base import REPO_ROOT
from voicebot.metrics import Metrics

DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.30.0"  # the oldest we support: it has the preStop sleep action
BIN = Path(sys.executable).parent


def resources() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def one(kind: str, name: str = "voicebot") -> dict:
    [found] = [d for d in resources() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def cluster_config():
    [generated] = yaml.safe_load((K8S / "kustomization.yaml").read_text())["configMapGenerator"]
    [file] = generated["files"]
    return generated["name"], file, load_settings(K8S / file)


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(BIN))
    assert path, f"{name} is not installed (scripts/test installs it)"
    return path


def test_every_resource_passes_the_kubernetes_schema_except_the_service_monitor():
    checked = set()
    for doc in resources():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in kubernetes-validate; checked structurally below
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        checked.add(doc["kind"])
    assert {"Deployment", "Service", "Ingress", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "PersistentVolumeClaim", "Namespace"} <= checked


def test_the_schema_check_rejects_a_broken_manifest():
    deployment = one("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_service_monitor_scrapes_the_service_metrics_port():
    monitor, service = one("ServiceMonitor"), one("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "authorization"}  # Prometheus Operator >= 0.51
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"


def test_the_pod_serves_one_gpu_with_probes_drain_and_models_from_the_init_container():
    _, config_file, settings = cluster_config()
    pod = one("Deployment")["spec"]["template"]["spec"]
    [server] = pod["containers"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {p["name"]: p["containerPort"] for p in server["ports"]} == {"http": settings.server.port}
    assert server["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert server["livenessProbe"]["httpGet"]["path"] == "/healthz"
    pre_stop_s = server["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + settings.server.shutdown_timeout_s
    config_path = f"{next(m['mountPath'] for m in server['volumeMounts'] if m['name'] == 'config')}/{config_file}"
    assert server["args"] == ["--config", config_path]
    [fetch] = pod["initContainers"]
    assert fetch["command"][-5:] == ["-m", "voicebot.models", "fetch", "--config", config_path]
    models_mount = {m["name"]: m["mountPath"] for m in fetch["volumeMounts"]}["models"]
    assert str(settings.tts.cosyvoice2.model_cache) == str(settings.asr.paraformer.model_cache) == models_mount


def test_the_cluster_config_points_at_the_redis_service():
    _, _, settings = cluster_config()
    redis = one("Service", "redis")
    assert settings.cluster.redis_url == f"redis://redis:{redis['spec']['ports'][0]['port']}/0"


def test_the_autoscaler_reads_a_metric_the_server_exports():
    [metric] = one("HorizontalPodAutoscaler")["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    exported = {m.name for m in Metrics().registry.collect()}
    assert name in exported
    adapter = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())
    assert [r["name"]["as"] for r in adapter["rules"]["custom"]] == [name]


def test_the_ingress_keeps_websockets_open_and_sticky():
    annotations = one("Ingress")["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/affinity"] == "cookie"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600


def test_yamllint_passes_on_deploy():
    result = subprocess.run([tool("yamllint"), "--strict", "-c", str(DEPLOY / ".yamllint"), str(DEPLOY)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_passes_on_the_dockerfiles():
    dockerfiles = [DEPLOY / "docker" / name for name in ("Dockerfile.cpu", "Dockerfile.cuda")]
    result = subprocess.run([tool("hadolint"), *map(str, dockerfiles)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def haproxy_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "VOICEBOT_LB_STATS": str(tmp_path / "admin.sock"), **env}
    return subprocess.run([tool("haproxy"), "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")],
                          capture_output=True, text=True, env=environment)


def test_haproxy_accepts_the_configuration(tmp_path):
    result = haproxy_check(tmp_path, VOICEBOT_1="127.0.0.1:8001", VOICEBOT_2="127.0.0.1:8002")
    assert result.returncode == 0, result.stdout + result.stderr


def test_haproxy_rejects_a_broken_server_address(tmp_path):
    assert haproxy_check(tmp_path, VOICEBOT_1="not an address:port").returncode != 0
