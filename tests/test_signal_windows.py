"""A signal can land between any two steps of a write, even between a file being made and its name being kept.
Here it lands right after each system call of an atomic write in turn: every time the target holds the earlier
output or the new one, whole, and no scratch is left beside it."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from llada_jax.system.atomic import MARKER, atomic_dir, atomic_write_bytes, previous_output, scratch_dir
from llada_jax.system.interrupts import Terminated, signals_deferred, sigterm_raises
from llada_jax.system.scratch import scratch_prefix
from tests.test_killed_writes import dead_pid

SYSTEM_CALLS = ("mkdir", "open", "rename", "replace", "chmod", "rmdir", "unlink")


@pytest.fixture(autouse=True)
def signals_raise():
    """SIGINT and SIGTERM as a CLI run gets them, whatever the test runner set."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with sigterm_raises():
        yield
    signal.signal(signal.SIGINT, previous)


class SignalAfterCall:
    """Wraps `os`'s system calls: while `at` is set, the `at`-th call (counted from 1) is followed by `signum`,
    as if it had arrived just as the call returned."""

    def __init__(self, monkeypatch, signum: int):
        self.signum, self.at, self.calls = signum, None, 0
        for name in SYSTEM_CALLS:
            monkeypatch.setattr(os, name, self.wrapped(getattr(os, name)))

    def wrapped(self, call):
        def after(*args, **kwargs):
            result = call(*args, **kwargs)
            if self.at is not None:
                self.calls += 1
                if self.calls == self.at:
                    signal.raise_signal(self.signum)
            return result
        return after

    def run(self, write, at: int) -> None:
        self.at, self.calls = at, 0
        try:
            write()
        finally:
            self.at = None


def interrupted_at_each_call(monkeypatch, signum: int, prepare, write, check) -> int:
    """`write()` on what `prepare()` made, with the signal after its 1st, 2nd, ... system call, and `check()` after
    each; the number of calls a whole write makes."""
    counter = SignalAfterCall(monkeypatch, signum)
    prepare()
    counter.run(write, 0)
    check()
    total = counter.calls
    for at in range(1, total + 1):
        prepare()
        with pytest.raises((KeyboardInterrupt, Terminated)):
            counter.run(write, at)
        check()
    return total


def write_output(target: Path, text: str, force: bool) -> None:
    with atomic_dir(target, "llada test", force=force) as staging:
        (staging / "weights.bin").write_text(text)
        (staging / "config.json").write_text(text)


def contents(target: Path) -> dict[str, str] | None:
    if not target.is_dir():
        return None
    return {path.name: path.read_text() for path in target.iterdir() if path.name != MARKER}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("earlier", [False, True], ids=["new", "replacing"])
def test_a_directory_write_interrupted_after_any_system_call_leaves_old_or_new_and_no_scratch(
        monkeypatch, tmp_path, signum, earlier):
    target = tmp_path / "out"

    def prepare():
        shutil.rmtree(target, ignore_errors=True)
        if earlier:
            write_output(target, "old", force=False)

    def check():
        assert sorted(path.name for path in tmp_path.iterdir()) == (["out"] if target.exists() else [])
        assert contents(target) in ({"weights.bin": "old", "config.json": "old"} if earlier else None,
                                    {"weights.bin": "new", "config.json": "new"})
        assert not target.exists() or previous_output(target) == "llada test"

    calls = interrupted_at_each_call(monkeypatch, signum, prepare, lambda: write_output(target, "new", earlier), check)
    assert calls >= (5 if earlier else 3)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_file_write_interrupted_after_any_system_call_leaves_old_or_new_and_no_scratch(monkeypatch, tmp_path, signum):
    target = tmp_path / "results.json"

    def check():
        assert [path.name for path in tmp_path.iterdir()] == ["results.json"]
        assert target.read_bytes() in (b"old", b"new")

    calls = interrupted_at_each_call(monkeypatch, signum, lambda: target.write_bytes(b"old"),
                                     lambda: atomic_write_bytes(target, b"new", "llada test"), check)
    assert calls >= 3


def test_a_scratch_directory_is_gone_after_its_block_whenever_the_signal_lands(monkeypatch, tmp_path):
    target = tmp_path / "libllada_kernels.so"
    host = scratch_prefix(target, "x").split(".")[-4]
    killed = tmp_path / f".{target.name}.llada-scratch.build-kernels.{host}.{dead_pid()}.0.abcdefgh"

    def prepare():
        (killed / "w4a8.o").parent.mkdir(exist_ok=True)
        (killed / "w4a8.o").write_bytes(b"o")

    def write():
        with scratch_dir(target, "build-kernels") as scratch:
            (scratch / "w4a8.o").write_bytes(b"o")

    def check():  # the killed run's scratch stays only when the signal stopped its removal: the next run's
        assert [path.name for path in tmp_path.iterdir()] in ([], [killed.name])

    assert interrupted_at_each_call(monkeypatch, signal.SIGINT, prepare, write, check) >= 4


@pytest.mark.parametrize("handler, raised", [(signal.default_int_handler, KeyboardInterrupt), (signal.SIG_IGN, None)])
def test_a_held_signal_reaches_the_earlier_handler_when_the_block_ends(handler, raised):
    signal.signal(signal.SIGINT, handler)
    reached = []
    try:
        with signals_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            reached.append("end of block")
    except KeyboardInterrupt as stop:
        reached.append(type(stop))
    assert reached == ["end of block"] + ([raised] if raised else [])
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_signal_while_the_handlers_are_set_back_leaves_every_one_back(monkeypatch):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    terminate, set_handler = signal.getsignal(signal.SIGTERM), signal.signal

    def set_then_interrupt(signum, handler):  # a second Ctrl-C just as SIGINT's handler is back
        previous = set_handler(signum, handler)
        if signum == signal.SIGINT and handler is signal.default_int_handler:
            signal.raise_signal(signal.SIGINT)
        return previous

    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            monkeypatch.setattr(signal, "signal", set_then_interrupt)
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) is terminate
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
