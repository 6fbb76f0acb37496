"""Progress on stderr for long commands: each stage on its own line with the seconds since the command began."""

from __future__ import annotations

import sys
import time


def stage_printer():
    """A `progress(message)` callback printing `[  12.3 s] message` to stderr."""
    began = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - began:7.1f} s] {message}", file=sys.stderr, flush=True)

    return progress
