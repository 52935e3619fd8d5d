"""Giving freed host memory back to the OS.

glibc's malloc keeps what a CPU training step frees (one arena per thread, and a free-space
threshold that grows with the largest block freed) for reuse, so a process's resident size
climbs to several times its live tensors: the default recipe sat at 2.9 GB after 12 steps for
~1.2 GB live. ``malloc_trim(0)`` returns the free pages; it takes about a millisecond.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _libc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim  # glibc only; musl has none
    except (OSError, AttributeError):
        return None


def release_host_memory() -> bool:
    """Return freed heap pages to the OS where the C library can (glibc); else a no-op.
    True when memory was given back."""
    trim = _libc_trim()
    return bool(trim(0)) if trim is not None else False


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (0 where unknown)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS bytes, Linux KiB
