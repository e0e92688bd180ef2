"""Freed heap pages back to the system, for the recall memory's block life (recall.py calls it every TRIM_EVERY
blocks)."""

from __future__ import annotations

import ctypes
from typing import Any


def trim_heap() -> None:
    """Give freed heap pages back to the system (glibc's malloc_trim; elsewhere nothing). Why: a block's life
    (stacked, rotated, encoded, written, its slices read back) frees ~1.5 MB of mixed-size allocations that glibc
    kept: streaming 14,000 tokens (bundled model, cache 1,024) grew RSS by 267 MB with the memory on (0 with it
    off); trimming after every block, by 93 MB, of which the slice cache (42 MB, bounded by --memory-ram) and the
    index (10 MB, bounded by the disk budget) are most."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC(0)


_LIBC: Any = None
