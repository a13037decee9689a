"""The heap policies, each in a fresh process: the arena cap (seen through glibc's own per-arena
statistics) and the GC freeze after start-up."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import pytest

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="arenas are glibc's")

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


@glibc_only
def test_threads_started_after_the_cap_share_its_arenas():
    env = _env_without_arena_max()
    _, uncapped = _arenas("free", env)
    capped_said, capped = _arenas("cap", env)
    assert uncapped >= 4  # the main arena plus one per allocating thread, up to 8 per core
    assert capped_said == "True" and capped == 2


@glibc_only
def test_an_operators_malloc_arena_max_is_left_alone():
    said, arenas = _arenas("cap", _env_without_arena_max() | {"MALLOC_ARENA_MAX": "3"})
    assert said == "False" and arenas <= 3


# Live objects and cyclic garbage made "at start-up"; then the policy, then what a full collection walks.
_STARTUP_HEAP = """
import gc, weakref
from voicebot import memory
class Node: pass
kept = [Node() for _ in range(1000)]
cycle = Node(); cycle.me = cycle
dead = weakref.ref(cycle); del cycle
frozen = memory.freeze_startup_heap()
walked = {id(o) for o in gc.get_objects()}
print(dead() is None, frozen >= 1000, any(id(k) in walked for k in kept), gc.get_freeze_count() == frozen)
memory.thaw_heap()
walked = {id(o) for o in gc.get_objects()}
print(gc.get_freeze_count(), all(id(k) in walked for k in kept))
"""


def test_startup_garbage_is_collected_and_the_rest_frozen_out_of_later_collections():
    done = subprocess.run([sys.executable, "-c", _STARTUP_HEAP], capture_output=True, text=True, timeout=60, check=True)
    after_freeze, after_thaw = done.stdout.splitlines()
    # The cycle freed first; the kept objects frozen: in no generation a collection walks.
    assert after_freeze == "True True False True"
    assert after_thaw == "0 True"
