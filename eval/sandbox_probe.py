"""Which sandbox layers work here: each candidate, strongest first, runs a probe program that passes only
if every layer it claims is really in place; the first that passes is the sandbox of this process."""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import sys

from eval.sandbox import PRIVATE_DIRS, UID_BASE, Limits, Sandbox, interpreter_mounts, run_program
from llada_jax.system.errors import LladaError

PROBE_LIMITS = Limits(timeout_s=30.0)


@functools.cache
def detect_sandbox() -> Sandbox:
    """The strongest sandbox whose probe passes here (probed once per process, strongest first)."""
    for candidate in candidates():
        if run_program(probe_source(candidate, PROBE_LIMITS), candidate, PROBE_LIMITS).passed:
            return candidate
    raise LladaError("cannot run a sandboxed python subprocess here (even without namespaces)")


def candidates() -> list[Sandbox]:
    spaces: list[tuple[str, ...]] = [("fsview", "netns", "pidns")] if shutil.which("bwrap") else []
    spaces += [("netns", "pidns"), ("netns",)] if shutil.which("unshare") else []
    spaces.append(())
    uid_modes = [(False, False)]
    if os.geteuid() == 0 and shutil.which("setpriv"):
        uid_modes = [(True, False), (True, True), (False, False)]
    return [Sandbox(space, drop, read_all) for space in spaces for drop, read_all in uid_modes]


def probe_source(sandbox: Sandbox, limits: Limits) -> str:
    """A program that passes only if every layer `sandbox` claims is really in place (run under `limits`)."""
    lines = ["import errno, os, socket, sys", f"assert sys.version == {sys.version!r}"]  # the harness's interpreter
    if "fsview" in sandbox.namespaces:
        lines += fsview_probe(limits.disk_bytes)
    if "netns" in sandbox.namespaces:  # a fresh namespace has a loopback and nothing else
        lines.append("assert [name for _, name in socket.if_nameindex()] == ['lo'], socket.if_nameindex()")
    if "netns" in sandbox.namespaces and "fsview" not in sandbox.namespaces:  # unshare leaves loopback down
        lines.append("assert socket.socket().connect_ex(('127.0.0.1', 9)) == errno.ENETUNREACH")
    if "pidns" in sandbox.namespaces:  # the parent is the supervisor, the namespace's init
        lines.append("assert os.getppid() == 1")
    if sandbox.drop_uid:
        lines.append(f"assert os.getuid() == {UID_BASE} and os.getgroups() == []")
    return "\n".join(lines)


def fsview_probe(disk_bytes: int) -> list[str]:
    """Probe lines: PRIVATE_DIRS hold at most the way down to the cwd, and they, /dev and the cwd's parent
    are read-only (not merely closed to the program's uid) while the cwd is writable (a probe file that does
    get created is removed at once) and holds at most `disk_bytes`."""
    name = f"llada-probe-{secrets.token_hex(8)}"
    return ["def write_error(path):",
            "    try:",
            "        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))",
            "    except OSError as error:",
            "        return error.errno",
            "    os.remove(path)",
            "    return 0",
            f"for private in {PRIVATE_DIRS!r}:",
            "    for entry in os.listdir(private):",
            (f"        assert os.getcwd().startswith(os.path.join(private, entry) + os.sep) or "
             f"os.path.join(private, entry) in {[str(path) for path in interpreter_mounts()]!r}, (private, entry)"),
            f"for place in [*{PRIVATE_DIRS!r}, '/dev', '..']:",
            f"    assert write_error(os.path.join(place, {name!r})) == errno.EROFS, place",
            f"assert write_error({name!r}) == 0",
            f"assert os.statvfs('.').f_blocks * os.statvfs('.').f_frsize <= {disk_bytes}, os.statvfs('.')"]
