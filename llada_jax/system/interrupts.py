"""SIGTERM as an exception, like SIGINT's KeyboardInterrupt: the cleanup blocks of an interrupted write run
(its scratch copy is removed) before the process exits with 128 + the signal's number."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Callable


class Terminated(BaseException):
    """SIGTERM arrived; a BaseException so that only cleanup blocks (`except BaseException`, `finally`) see it."""

    exit_status = 128 + signal.SIGTERM


@contextlib.contextmanager
def sigterm_raises():
    """Inside the block SIGTERM raises `Terminated` in the main thread (signal handlers can only be set there);
    the previous handler is back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def run_interruptible(prog: str, work: Callable[[], object]) -> int:
    """`work()` with SIGTERM raising: 0, or after a one-line message, 130 (SIGINT) or 143 (SIGTERM). Other
    errors pass through to the caller."""
    try:
        with sigterm_raises():
            work()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Terminated as stop:
        print(f"{prog}: interrupted (SIGTERM)", file=sys.stderr)
        return stop.exit_status
    return 0
