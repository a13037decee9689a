"""Fixtures for the FunASR tests: random-weight model directories and a network guard.

The models are tiny but of the real classes, written in the real file layout and loaded by the
same code as real weights (voicebot.asr.funasr_model). Every test here runs under a socket guard
that refuses and records any connection that is not to the loopback interface.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import pytest
import torch

from tests.asr.tiny_models import build_model_dir

torch.set_num_threads(1)

_attempts: list[str] = []


def _is_loopback(address: object) -> bool:
    host = address[0] if isinstance(address, tuple) else address
    if isinstance(host, str) and host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return isinstance(address, (str, bytes))  # AF_UNIX paths are local by definition


@pytest.fixture(scope="session", autouse=True)
def socket_guard():
    """Refuse every non-loopback connection or DNS lookup for the whole session, recording it."""
    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex
    original_getaddrinfo = socket.getaddrinfo

    def connect(self, address):
        if not _is_loopback(address):
            _attempts.append(f"connect {address!r}")
            raise ConnectionRefusedError(f"network access in a test: {address!r}")
        return original_connect(self, address)

    def connect_ex(self, address):
        if not _is_loopback(address):
            _attempts.append(f"connect_ex {address!r}")
            return 111
        return original_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if not _is_loopback(host if host is not None else "127.0.0.1"):
            _attempts.append(f"getaddrinfo {host!r}")
            raise socket.gaierror(f"DNS lookup in a test: {host!r}")
        return original_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
    yield _attempts
    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = (
        original_connect, original_connect_ex, original_getaddrinfo)


@pytest.fixture(autouse=True)
def no_network(socket_guard):
    before = len(socket_guard)
    yield
    assert socket_guard[before:] == [], "a test tried to reach the network"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, socket_guard) -> dict[str, Path]:
    """Model directories: the three classes, plus decoders made confident or unsure by their weights."""
    root = tmp_path_factory.mktemp("funasr-models")
    specs = {
        "streaming": ("paraformer-streaming", "random"),
        "offline": ("paraformer", "random"),
        "vad": ("fsmn-vad", "random"),
        "streaming-sure": ("paraformer-streaming", "high"),
        "streaming-unsure": ("paraformer-streaming", "low"),
        "offline-sure": ("paraformer", "high"),
        "offline-unsure": ("paraformer", "low"),
    }
    return {name: build_model_dir(root / name, kind, confidence=conf) for name, (kind, conf) in specs.items()}


@pytest.fixture(scope="module")
def recognizer(tiny_models):
    """The streaming tiny model through the real recognizer, one per test module."""
    from voicebot.asr.paraformer import ParaformerRecognizer
    from voicebot.config.engines import ParaformerConfig

    rec = ParaformerRecognizer(ParaformerConfig(model=str(tiny_models["streaming"])))
    rec.load()
    yield rec
    rec.close()
