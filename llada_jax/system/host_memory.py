"""Host memory: aligned buffers that XLA uses in place, and freed memory handed back to the OS, so peak RSS
measures what is live."""

from __future__ import annotations

import ctypes
import math

import numpy as np

ALIGN = 64  # bytes: XLA's CPU client aliases host buffers aligned to this, and copies others


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array whose data starts on an ALIGN-byte boundary."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start: start + nbytes].view(dtype).reshape(shape)


def release_freed_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim).

    Reading weights leaves freed blocks in the heap that glibc keeps resident; the first step's compile
    then peaked ~1 GB higher (LLaDA-8B bf16: 17.9 GB RSS, 16.9 GB after a trim). Fixing glibc's mmap
    threshold instead cut the same peak but made every large temporary a fresh mapping: int4 steps ran
    1.7x slower. False where the C library has no malloc_trim."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
