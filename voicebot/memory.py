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

Python's own heap has a third: the cyclic GC's full (generation 2) collection walks every tracked
object, and the engines leave a couple of hundred thousand of them after start-up (the default
config: 232,000; 0.2-0.3 s a collection on a loaded 2-core box), while holding the GIL, so every
thread, the event loop's too, stops for it. `freeze_startup_heap` moves what start-up built into
the permanent generation, which no collection walks: a full collection then walks what sessions
made since (0.01 ms right after). What is frozen is never collected; start-up's objects live as
long as the process anyway (`thaw_heap` at shutdown lets them go).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
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


def freeze_startup_heap() -> int:
    """Collect start-up's garbage, then exempt every object left from all later collections; the
    number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Make frozen objects collectable again (at shutdown: a process that builds another app, as
    the tests do, must be able to free this one's engines)."""
    gc.unfreeze()


def release_freed_memory() -> bool:
    """Return free heap pages to the system; False where the C library cannot."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim and trim(0))


async def trim_periodically(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Hand freed pages back every interval, off the event loop, until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(release_freed_memory)
