"""The heap arena cap, seen through glibc's own per-arena statistics in a fresh process."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="arenas are glibc's")

# Threads that each allocate as they start: uncapped, glibc gives each new thread an arena of its own.
_THREADS_ALLOCATING = """
import ctypes, sys, threading
from voicebot import memory
capped = memory.limit_heap_arenas(2) if sys.argv[1] == "cap" else None
start = threading.Barrier(6)
def work():
    start.wait()
    kept = [bytearray(4096) for _ in range(200)]  # over pymalloc's 512 bytes: glibc's malloc
    start.wait()
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads: t.start()
for t in threads: t.join()
print(capped)
ctypes.CDLL(None).malloc_stats()  # one "Arena N:" block per arena, on stderr
"""


def _arenas(mode: str, env: dict[str, str]) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", _THREADS_ALLOCATING, mode], capture_output=True, text=True,
                          timeout=60, env=env, check=True)
    return done.stdout.strip(), len(re.findall(r"^Arena \d+:", done.stderr, re.MULTILINE))


def _env_without_arena_max() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}


def test_threads_started_after_the_cap_share_its_arenas():
    env = _env_without_arena_max()
    _, uncapped = _arenas("free", env)
    capped_said, capped = _arenas("cap", env)
    assert uncapped >= 4  # the main arena plus one per allocating thread, up to 8 per core
    assert capped_said == "True" and capped == 2


def test_an_operators_malloc_arena_max_is_left_alone():
    said, arenas = _arenas("cap", _env_without_arena_max() | {"MALLOC_ARENA_MAX": "3"})
    assert said == "False" and arenas <= 3
