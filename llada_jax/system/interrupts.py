"""SIGTERM as an exception, like SIGINT's KeyboardInterrupt: the cleanup blocks of an interrupted write run
(its scratch copy is removed) before the process exits with 128 + the signal's number."""

from __future__ import annotations

import signal
import threading


class Terminated(BaseException):
    """SIGTERM arrived; a BaseException so that only cleanup blocks (`except BaseException`, `finally`) see it."""

    exit_status = 128 + signal.SIGTERM


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises `Terminated` in the main thread (signal handlers can only be set there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def _raise_terminated(signum, frame) -> None:
    raise Terminated()
