"""Freed host memory goes back to the OS, so peak RSS measures what is live."""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter
MMAP_THRESHOLD = 1 << 20


def return_freed_blocks() -> bool:
    """Serve allocations of 1 MiB or more from their own mappings, returned to the OS when freed.

    glibc raises this threshold by itself (up to 32 MiB) once large blocks are freed, as reading weights
    does; XLA's compiler then left 1-2 GB of freed blocks resident (LLaDA-8B bf16: a step's compile
    peaked at 17.9 GB RSS, 16.9 GB with the threshold fixed). False where the C library has no mallopt."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
