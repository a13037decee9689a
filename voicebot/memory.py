"""Hand freed heap memory back to the operating system.

glibc's malloc keeps the pages of freed blocks for reuse, and in a long-running process that
allocates and frees large models per session (a pocketsphinx Decoder is about 90 MB) the freed
space stays in RSS: fragmented by the small allocations that outlive it, it is never returned on
its own. `malloc_trim(0)` returns every free page. It walks the heap (tens of ms right after a
large free, under 1 ms otherwise), so call it off the event loop, after freeing something large.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)  # glibc only (not musl, not macOS)


def release_freed_memory() -> bool:
    """Return free heap pages to the system; False where the C library cannot."""
    trim = _malloc_trim()
    return bool(trim and trim(0))
