"""glibc malloc tuning for a long-running server with many threads.

glibc gives each thread that contends for the heap its own arena (up to 8 per core) and keeps
freed memory in them; after a bulk load or an index optimisation that freed memory stays in the
process's RSS. Capping the arenas and trimming after big frees keeps RSS close to what is in use.
Elsewhere (musl, macOS) both calls do nothing.
"""

import ctypes
import ctypes.util
import logging

log = logging.getLogger("memory_server")
_M_ARENA_MAX = -8


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


_LIBC = _libc()


def limit_arenas(count: int = 2) -> None:
    if _LIBC is not None:
        _LIBC.mallopt(_M_ARENA_MAX, count)


def release_free_memory() -> None:
    """Hand freed heap pages back to the operating system."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
