"""A real voicebot server on 127.0.0.1 in a thread of the test process, and the audio the tests speak."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile
import uvicorn

from tests.audio import espeak_speech
from voicebot.config import DEFAULT_CONFIG, load_settings

# The closed grammar pocketsphinx decodes against: every sentence a test speaks.
PHRASES = {
    "first": "hello there how are you today",
    "barge": "what is the weather like tomorrow",
    "song": "could you sing me a song about the summer rain",
}


def speech(*parts: str | float, rate: int = 16000) -> np.ndarray:
    """Concatenate espeak sentences (str) and silences (float seconds) at `rate`."""
    pieces = [np.zeros(int(p * rate), np.float32) if isinstance(p, (int, float)) else espeak_speech(p, rate=rate) for p in parts]
    return np.concatenate(pieces)


def write_wav(path: Path, audio: np.ndarray, rate: int = 16000) -> Path:
    soundfile.write(str(path), audio, rate, subtype="PCM_16")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`with LiveServer(**overrides) as server:` serves create_app(settings) until the block ends."""

    def __init__(self, **overrides) -> None:
        self.port = _free_port()
        overrides = {
            "server": {"port": self.port, "record_input_s": 30, **overrides.pop("server", {})},
            "asr": {"engine": "pocketsphinx", "pocketsphinx": {"phrases": list(PHRASES.values())}},
            **overrides,
        }
        self.settings = load_settings(DEFAULT_CONFIG, **overrides)

    def url(self, path: str, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> "LiveServer":
        from voicebot.app import create_app

        self.app = create_app(self.settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", ws_max_size=2 * 48000 * 2 + 1024)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="live-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url("/readyz"), timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the test server did not become ready in 60 s")

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(15)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 when absent)."""
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in httpx.get(self.url("/metrics")).text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0
