"""The memory a parse freed, given back to the system."""

from __future__ import annotations

import ctypes


def give_back_memory() -> None:
    """Return the heap's free memory to the system: glibc keeps the memory a parsed LIST page
    freed mapped in its arenas (the RSS stays at the LIST's high-water mark) until
    `malloc_trim(0)`. A no-op where the C library has none (musl)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:  # no C library to load symbols from
        return None


_LIBC = _libc()
