"""Keep glibc's heap from growing with the hours: a fixed number of arenas, free pages handed back.

Two behaviours of glibc's malloc make a long-running server's RSS climb in steps that never come
back down:
- Arenas. A thread that finds its arena locked by another moves to a new one, up to 8 per core,
  each a 64 MB heap region. The engines' worker threads, onnxruntime's and OpenMP's pools all
  allocate, and each arena keeps the high-water mark of what was allocated on it: a soak's server
  (10 sessions, 2 cores) held about a dozen arenas, 20-68 MB resident each, their sizes moving
  from one to another between snapshots. `limit_heap_arenas` caps them before the engines start
  their threads, as MALLOC_ARENA_MAX would. (That soak's one late step of ~65 MB was not glibc's
  but onnxruntime's own arena: voicebot/audio/turn.py.)
- Free pages. Memory freed inside a heap stays resident until something calls `malloc_trim`:
  fragmented by small blocks that outlive it, it is never returned on its own (a pocketsphinx Decoder
  is about 90 MB). `release_freed_memory` returns every free page. It walks the heaps (tens of ms
  right after a large free, under 1 ms otherwise), so it runs off the event loop: after freeing
  something large, and every minute (`trim_periodically`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import os


# mallopt's parameter number for the arena cap (glibc's malloc.h).
_M_ARENA_MAX = -8
# Two arenas: the event loop's thread keeps the main one, all other threads share the second.
HEAP_ARENAS = 2
TRIM_INTERVAL_S = 60.0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def limit_heap_arenas(arenas: int = HEAP_ARENAS) -> bool:
    """Cap glibc's malloc arenas for threads started from now on; False where the C library cannot.

    An operator's own MALLOC_ARENA_MAX wins: glibc has read it at start-up and it is left alone.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = getattr(_libc(), "mallopt", None)  # glibc only (not musl, not macOS)
    return bool(mallopt and mallopt(_M_ARENA_MAX, arenas))


def release_freed_memory() -> bool:
    """Return free heap pages to the system; False where the C library cannot."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim and trim(0))


async def trim_periodically(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Hand freed pages back every interval, off the event loop, until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(release_freed_memory)
