"""Shared test helpers: the real server on 127.0.0.1 (on a port it binds itself), and a WebSocket voice client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import pytest

from tests.audio import SPEECH_DIR_ENV, espeak_speech, to_pcm16
from voicebot.config import Settings, load_settings

TEST_PHRASES = [
    "hello there how are you",
    "please tell me a joke about the weather",
    "what time does the show start tomorrow",
    "stop talking now",
]

_SPEECH_DIR_MADE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    # Made before pytest-xdist starts its workers, which inherit the variable: one directory of
    # synthesized speech for the whole run (tests/audio.py), removed by the process that made it.
    if not os.environ.get(SPEECH_DIR_ENV):
        os.environ[SPEECH_DIR_ENV] = config.stash[_SPEECH_DIR_MADE] = tempfile.mkdtemp(prefix="voicebot-test-speech-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if made := config.stash.get(_SPEECH_DIR_MADE, None):
        shutil.rmtree(made, ignore_errors=True)
        del os.environ[SPEECH_DIR_ENV]


# The probes of free_port, bound until this process exits: one socket per call.
_HELD_PORTS: list[socket.socket] = []


def free_port() -> int:
    """A port for a server in another process (run_server.py, redis-server, HAProxy), which no other
    process is handed until this one ends. A port bound and released could be handed by the kernel
    to another xdist worker's bind(0) before the server took it; so the probe stays bound, with
    SO_REUSEADDR and never listening: bind(0) skips a bound port, and the servers, which all bind
    with SO_REUSEADDR, can still take it. A server in this process binds port 0 instead (running_server)."""
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    probe.bind(("127.0.0.1", 0))
    _HELD_PORTS.append(probe)
    return probe.getsockname()[1]


def bound_port(server) -> int:
    """The port a started uvicorn.Server listens on (it was given port 0: the kernel chose)."""
    return server.servers[0].sockets[0].getsockname()[1]


def make_settings(**overrides: Any) -> Settings:
    """The default config with a phrase grammar (deterministic transcripts) and port 0: the server
    binds a port of the kernel's choosing, and running_server writes it back into the settings."""
    # Test servers run inside pytest's process, so the whole-process CPU that admission reads as the
    # `server` pool is the tests' too (their clients, the module's other servers): a pool full or a
    # burst of connects says nothing of the server there. Admission's rules are tested on their own
    # (tests/unit/test_capacity.py, tests/serving/test_input_lag.py sets its cold start).
    # 4 decoders, not the grammar's default 17 (voicebot/asr/pocketsphinx.py's POOL_MB): a test's
    # server serves a few streams, and every build is CPU the suite's other servers wait for.
    base = {"server": {"port": 0}, "asr": {"pocketsphinx": {"phrases": TEST_PHRASES, "decoders": 4}},
            "limits": {"max_worker_load": 1.0, "cold_start_sessions": 64}}
    for key, value in overrides.items():
        base.setdefault(key, {}).update(value) if isinstance(value, dict) else base.__setitem__(key, value)
    return load_settings(None, **base)


@dataclass
class RunningServer:
    settings: Settings
    server: Any
    thread: threading.Thread
    app: Any

    @property
    def runtime(self):
        return self.app.state.runtime

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.server.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.settings.server.port}/v1/voice"

    def get(self, path: str) -> httpx.Response:
        token = self.settings.server.token  # every route but the probes and pages asks for it
        return httpx.get(self.http_url + path, timeout=10, headers={"Authorization": f"Bearer {token}"} if token else None)

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample in /metrics (0 when absent)."""
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the server's event loop (to read its state safely)."""
        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.runtime.loop).result(10)


@contextlib.contextmanager
def running_server(settings: Settings) -> Iterator[RunningServer]:
    import uvicorn

    from voicebot.app import create_app

    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.server.port, log_level="warning",
                                           ws_per_message_deflate=False))  # as run_server.py
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    settings.server.port = bound_port(server)  # what the tests' URLs are made of
    running = RunningServer(settings, server, thread, app)
    try:
        asyncio.run(_warm_up(running))
        # The warm-up session is released once the server has seen the close: wait for it, so a
        # test's sessions are the only ones (max_sessions tests count on it).
        deadline = time.monotonic() + 10
        while running.runtime.sessions and time.monotonic() < deadline:
            time.sleep(0.02)
        yield running
    finally:
        server.should_exit = True
        thread.join(30)


async def _warm_up(server: RunningServer) -> None:
    """One utterance, so pocketsphinx has learned its cepstral mean before the test's own audio
    (its first utterance after start-up is decoded cold and may be cut short)."""
    async with VoiceClient.connect(server.ws_url) as client:
        await client.stream(speech_pcm(TEST_PHRASES[0]), speed=4)
        await client.wait_for("asr.final")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(make_settings()) as s:
        yield s


def speech_pcm(text: str, rate: int = 16000, lead_s: float = 0.3, tail_s: float = 1.0) -> bytes:
    """espeak speech with silence before and after (so the endpointer sees its end), s16le."""
    audio = espeak_speech(text, rate=rate)
    return to_pcm16(np.concatenate([np.zeros(int(rate * lead_s), np.float32), audio, np.zeros(int(rate * tail_s), np.float32)]))


@dataclass
class VoiceClient:
    """A test client: streams PCM in real time and records every event and frame it receives."""

    ws: Any
    events: list[dict] = field(default_factory=list)
    frames: list[tuple[str | None, bytes]] = field(default_factory=list)  # (reply_id, frame)
    _reply: str | None = None
    _new: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, url: str, send_start: bool = True, **start: Any):
        import websockets

        async with websockets.connect(url, max_size=None) as ws:
            client = cls(ws)
            reader = asyncio.create_task(client._read())
            try:
                if send_start:
                    await client.send({"type": "session.start", **start})
                    await client.wait_for("session.ready")
                yield client
            finally:
                reader.cancel()

    async def send(self, message: dict) -> None:
        await self.ws.send(json.dumps(message))

    async def _read(self) -> None:
        with contextlib.suppress(Exception):
            async for message in self.ws:
                if isinstance(message, bytes):
                    self.frames.append((self._reply, message))
                else:
                    event = json.loads(message)
                    if event["type"] == "audio.start":
                        self._reply = event["reply_id"]
                    self.events.append(event)
                self._new.set()

    async def stream(self, pcm: bytes, rate: int = 16000, chunk_ms: int = 100, speed: float = 1.0) -> None:
        """Send audio in chunks at `speed` times real time."""
        step = rate * chunk_ms // 1000 * 2
        for i in range(0, len(pcm), step):
            await self.ws.send(pcm[i : i + step])
            await asyncio.sleep(chunk_ms / 1000 / speed)

    async def wait_for(self, kind: str, count: int = 1, timeout: float = 30, **match: Any) -> dict:
        """Wait until `count` events of this type (and fields) have arrived; return the last."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events if e["type"] == kind and all(e.get(k) == v for k, v in match.items())]
            if len(found) >= count:
                return found[count - 1]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {kind} {match} after {timeout} s; got {[e['type'] for e in self.events]}")
            self._new.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._new.wait(), remaining)

    def of_type(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def reply_frames(self, reply_id: str) -> list[bytes]:
        return [f for r, f in self.frames if r == reply_id]


def start_server_process(config_dir, server: dict, stdout: int | None = None):
    """run_server.py in a process of its own, on a free port, with `server` as its config's server
    section; returns (process, port) once /readyz answers. The caller stops it (SIGTERM or kill)."""
    import subprocess
    import sys

    import yaml

    from voicebot.config.base import REPO_ROOT

    port = free_port()
    config = config_dir / "server.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": port, **server}}))
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "run_server.py"), "--config", str(config)], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL if stdout is None else stdout, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc, port
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("run_server.py did not start")
        time.sleep(0.2)


@pytest.fixture
def input_clock():
    """A running input clock (voicebot/serving/input_clock.py), stopped after the test."""
    from voicebot.serving.input_clock import InputClock

    clock = InputClock()
    clock.start()
    yield clock
    clock.stop()


@pytest.fixture
def batcher():
    """A running VAD batcher of up to 4 rows a call, stopped after the test."""
    from voicebot.serving.vad import VadBatcher

    b = VadBatcher(max_batch=4)
    b.start()
    yield b
    b.stop()
