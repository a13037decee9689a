"""Real redis-server, haproxy and voicebot processes on 127.0.0.1, in temporary directories, for the cluster tests and bench/cluster.py."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.conftest import TEST_PHRASES, free_port
from voicebot.config.base import REPO_ROOT


def need(tool: str) -> str:
    path = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/bin")
    assert path, f"{tool} is not installed (scripts/test installs it with apt)"
    return path


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} within {timeout_s} s")


class Process:
    """A child process whose output goes to a log file (read it when something fails)."""

    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = workdir / f"{name}.log"
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Process":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                     env={**os.environ, **(self.env or {})}, start_new_session=True)
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 20) -> int | None:
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


class RedisServer(Process):
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        data = workdir / f"redis-{self.port}"
        data.mkdir(parents=True, exist_ok=True)
        super().__init__(f"redis-{self.port}", [need("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                                                "--save", "", "--appendonly", "no", "--dir", str(data)], workdir)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        super().start()

        def answers() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        wait_until(answers, 10, f"redis-server on port {self.port} answers")
        return self

    def stop(self, timeout_s: float = 10) -> int | None:
        if self.alive():
            self.proc.kill()  # gone at once, as a crashed or unplugged Redis would be
            self.proc.wait(timeout_s)
        return self.proc.returncode if self.proc else None


class VoicebotServer(Process):
    def __init__(self, workdir: Path, name: str, redis_url: str | None, **sections) -> None:
        self.port = free_port()
        config = {"server": {"port": self.port, "shutdown_timeout_s": 10},
                  "asr": {"pocketsphinx": {"phrases": TEST_PHRASES}}}
        if redis_url:
            config["cluster"] = {"redis_url": redis_url, "reconnect_interval_s": 0.2}
        for section, values in sections.items():
            config.setdefault(section, {}).update(values)
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        super().__init__(name, [sys.executable, str(REPO_ROOT / "run_server.py"), "--config", str(self.config_path)], workdir,
                         env={"OMP_NUM_THREADS": "1"})

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.address}/v1/voice"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"http://{self.address}{path}", timeout=5)

    def ready(self) -> bool:
        try:
            return self.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = 120) -> "VoicebotServer":
        def ready_or_dead() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            return self.ready()

        wait_until(ready_or_dead, timeout_s, f"{self.name} ready")
        return self

    def metric(self, name: str, labels: str = "") -> float:
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0


class HAProxy(Process):
    """deploy/haproxy/haproxy.cfg as shipped, its variables pointing at the test's servers."""

    def __init__(self, workdir: Path, servers: list[VoicebotServer], **env: str) -> None:
        self.port = free_port()
        variables = {"VOICEBOT_LB_BIND": f"127.0.0.1:{self.port}", "VOICEBOT_LB_STATS": str(workdir / "haproxy.sock"), **env}
        variables.update({f"VOICEBOT_{i}": s.address for i, s in enumerate(servers, 1)})
        super().__init__("haproxy", [need("haproxy"), "-db", "-f", str(REPO_ROOT / "deploy" / "haproxy" / "haproxy.cfg")],
                         workdir, env=variables)
        self.stats_socket = variables["VOICEBOT_LB_STATS"]

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/voice"

    def start(self) -> "HAProxy":
        super().start()
        wait_until(lambda: self._answers(), 10, "haproxy listens")
        return self

    def _answers(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/lb-healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def admin(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.stats_socket)
            s.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def servers_up(self) -> dict[str, bool]:
        """Server name -> in the pool (its health check passes), from `show stat`."""
        lines = self.admin("show stat").splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","))) for line in lines[1:] if line]
        return {r["svname"]: r["status"].startswith("UP") for r in rows if r["pxname"] == "voicebot" and r["svname"] not in ("FRONTEND", "BACKEND")}


def start_behind_haproxy(workdir: Path, servers: list[VoicebotServer], **lb_env: str) -> HAProxy:
    """Start every server, wait until each is ready, then HAProxy in front of them, returned once it
    sees them all up (stopped again if it never does)."""
    for server in servers:
        server.start()
    for server in servers:
        server.wait_ready()
    lb = HAProxy(workdir, servers, **lb_env).start()
    try:
        wait_until(lambda: all(lb.servers_up().values()), 15, "haproxy sees every server up")
    except BaseException:
        lb.stop()
        raise
    return lb
