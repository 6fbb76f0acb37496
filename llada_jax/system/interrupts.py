"""SIGTERM as an exception, like SIGINT's KeyboardInterrupt: the cleanup blocks of an interrupted write run
(its scratch copy is removed) before the process exits with 128 + the signal's number."""

from __future__ import annotations

import contextlib
import gc
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


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM that arrive inside the block are held and delivered, to the handlers in force before,
    when it ends: a step that creates something and records where (a scratch directory, the swap of an output)
    is never cut between the two, so the cleanup blocks know about everything there is to remove. Outside the
    main thread no signal handler runs, so there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {signum: signal.signal(signum, lambda number, frame: held.append(number)) for signum in _HELD
                if signal.getsignal(signum) is not None}  # None: a handler set outside Python, not ours to restore
    try:
        yield
    finally:
        _restore(list(previous.items()))
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


_HELD = (signal.SIGINT, signal.SIGTERM)


def _restore(handlers: list) -> None:
    """Each (signal, handler) set back, even when a signal that reaches a handler already back raises."""
    if handlers:
        try:
            signal.signal(*handlers[0])
        finally:
            _restore(handlers[1:])


def run_interruptible(prog: str, work: Callable[[], object]) -> int:
    """`work()` with SIGTERM raising: 0, or after a one-line message, 130 (SIGINT) or 143 (SIGTERM). Other
    errors pass through to the caller."""
    previous_hook = sys.unraisablehook
    try:
        with sigterm_raises():
            work()
        return 0
    except KeyboardInterrupt:
        sys.unraisablehook = _ignore_unraisable
        message, status = f"{prog}: interrupted", 130
    except Terminated as stop:
        sys.unraisablehook = _ignore_unraisable
        message, status = f"{prog}: interrupted (SIGTERM)", stop.exit_status
    try:
        gc.collect()  # objects the signal left half-built (a progress bar mid-__init__) fail in __del__: quietly
    finally:
        sys.unraisablehook = previous_hook
    print(message, file=sys.stderr)
    return status


def _ignore_unraisable(unraisable) -> None:
    pass
