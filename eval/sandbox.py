"""Run untrusted Python (model-written code) in a fresh `python -I` process, never in the harness.

A trusted supervisor (`python -I -c SUPERVISOR`, its own session) starts the program in a fresh temp dir,
in a session and process group of its own, with resource limits set by a preexec function; at the
wall-clock timeout, and after any exit, it SIGKILLs the program's process group. Layers, each named in the
level string only when a probe at startup (`eval.sandbox_probe`) showed it works here:
- fsview: `bwrap` (bubblewrap) builds the supervisor a mount namespace in which `/` is read-only, /tmp,
  /var/tmp and /dev/shm are private, empty and read-only, /dev (read-only) and /proc are fresh, and only the
  sample's work dir (its cwd, also its TMPDIR and HOME: an empty tmpfs of `disk_bytes`, so its files are bounded
  in all, not only each one) and the supervisor's output dir are writable, each at its host path. A sample can
  neither leave files behind nor touch another's. bwrap also makes the netns and pidns
  below (and private IPC and UTS namespaces); as root it keeps only the capabilities the uid drop needs;
- netns: a network namespace of its own: only a loopback (down under `unshare --net`, up but private under
  bwrap), so no connection leaves it;
- pidns: a pid namespace whose init is the supervisor (`unshare --pid --fork`, or bwrap `--as-pid-1`), so
  after the program it kills every process left in the namespace (`kill(-1)` reaches nothing outside it)
  and reaps them all;
- uid (root harness only): the program runs as uid/gid UID_BASE + slot via `setpriv` (no groups, no new
  privileges). Linux exempts uid 0 from RLIMIT_NPROC, so only this makes the process limit bite for a root
  harness; it also keeps the program from signalling its root parent or writing root-owned files.
  `uid-readall`: that uid could not reach the interpreter (a venv under a 0700 /root), so it keeps
  CAP_DAC_READ_SEARCH: it may read any file, and still writes only where its uid may (its work dir, and
  without fsview world-writable places such as /tmp, each file within RLIMIT_FSIZE);
- rlimits: address space, CPU seconds (a backstop behind the wall clock), processes, file size, open
  files, no core files;
- pgroup: the program's own process group, killed as a whole; the harness likewise kills the supervisor's
  group should the supervisor itself overrun.
Without fsview a sample may write wherever its uid may; without pidns, processes that left the program's
group survive it; without uid, RLIMIT_NPROC counts all of the harness user's processes (its current count +
the limit is allowed) and does nothing for root. bwrap is tried first; `unshare` is the fallback.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from llada_jax.system.errors import LladaError

UID_BASE = 61_000        # slot s runs as uid UID_BASE + s (unallocated ids below systemd's dynamic range)
BACKSTOP_S = 20.0        # the harness kills a supervisor this long past the program's own timeout
TAIL_BYTES = 4096        # how much of the program's stdout/stderr is read back
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # under fsview: empty and read-only to the program
SETPRIV_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")  # what the supervisor's `setpriv` uid drop needs

# Runs first in every sandbox (the namespace's init when there is a pid namespace). Single-threaded, so its
# preexec function (the resource limits) is safe. Invariant: the program's group leader is reaped only
# after its group was killed, so `killpg(pid)` can never reach a group that reused the id.
SUPERVISOR = r"""
import json, os, resource, signal, subprocess, sys, time
spec = json.loads(sys.argv[1])

def apply_limits():
    for name, value in spec["rlimits"]:
        limit = getattr(resource, name)
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))

with open(spec["stdout"], "wb") as out, open(spec["stderr"], "wb") as err:
    program = subprocess.Popen(spec["command"], cwd=spec["cwd"], env=spec["env"], stdin=subprocess.DEVNULL,
                               stdout=out, stderr=err, start_new_session=True, preexec_fn=apply_limits)
deadline, pause, timed_out = time.monotonic() + spec["timeout"], 0.001, False
while os.waitid(os.P_PID, program.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
    if time.monotonic() > deadline:
        timed_out = True
        break
    time.sleep(pause)
    pause = min(2 * pause, 0.05)
try:
    os.killpg(program.pid, signal.SIGKILL)
except ProcessLookupError:
    pass
if os.getpid() == 1:
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
returncode = program.wait()
while os.getpid() == 1:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
print(json.dumps({"returncode": returncode, "timed_out": timed_out}))
"""


MAX_LIMIT = 2**40  # seconds or bytes: far beyond any sample, well inside what setrlimit and timers take


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    memory_bytes: int = 1 << 30
    processes: int = 32
    file_bytes: int = 16 << 20
    open_files: int = 64
    disk_bytes: int = 64 << 20  # all of the work dir's files (under fsview; without it, each file's size only)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not 0 < value <= MAX_LIMIT:  # the kernel's resource limits are 64-bit
                raise LladaError(f"sandbox limit {field.name} must be in (0, {MAX_LIMIT}], got {value}")


@dataclasses.dataclass(frozen=True)
class Sandbox:
    namespaces: tuple[str, ...] = ()   # e.g. ("netns", "pidns"); with "fsview", bwrap makes all of them
    drop_uid: bool = False
    read_all: bool = False             # the dropped uid keeps CAP_DAC_READ_SEARCH

    @property
    def level(self) -> str:
        uid = ("uid-readall" if self.read_all else "uid",) if self.drop_uid else ()
        return "+".join((*self.namespaces, *uid, "rlimits", "pgroup"))

    def supervisor_command(self, spec: dict, base: Path, work: Path, io: Path, disk_bytes: int) -> list[str]:
        """The supervisor inside the namespaces. Under fsview it sees the host dir `base` read-only, the
        program's `work` dir in it as an empty tmpfs of `disk_bytes` and its own `io` dir read-write (the only
        places it or the program may write)."""
        wrapper = []
        if "fsview" in self.namespaces:
            wrapper = bwrap_wrapper(base, work, io, disk_bytes, self.kept_caps())
        elif self.namespaces:
            wrapper = unshare_wrapper("pidns" in self.namespaces)
        return wrapper + [sys.executable, "-I", "-c", SUPERVISOR, json.dumps(spec)]

    def kept_caps(self) -> tuple[str, ...]:
        """The capabilities a root supervisor keeps under bwrap (which drops all others)."""
        if not self.drop_uid:
            return ()
        return SETPRIV_CAPS + (("CAP_DAC_READ_SEARCH",) if self.read_all else ())

    def program_command(self, slot: int, script: Path) -> list[str]:
        prefix = []
        if self.drop_uid:
            uid = UID_BASE + slot
            caps = ",+dac_read_search" if self.read_all else ""
            prefix = [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                      "--no-new-privs", f"--inh-caps=-all{caps}", f"--bounding-set=-all{caps}"]
            if self.read_all:
                prefix.append("--ambient-caps=+dac_read_search")
            prefix.append("--")
        return prefix + [sys.executable, "-I", str(script)]


def bwrap_wrapper(base: Path, work: Path, io: Path, disk_bytes: int, caps: tuple[str, ...]) -> list[str]:
    """bwrap's command line for the fsview layer (and with it netns and pidns): `/` read-only, PRIVATE_DIRS
    empty and read-only, `base` read-only (bound, so it keeps its host mode: a mount point that bwrap makes
    is 0700, closed to the sample's uid), `work` in it an empty tmpfs of `disk_bytes` that any uid may write,
    and `io` in it read-write, all at their host paths."""
    wrapper = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for private in PRIVATE_DIRS:
        wrapper += ["--tmpfs", private]
    # Order matters: the binds come after the tmpfs they may lie in, and each remount-ro after the binds,
    # since it makes read-only only that one mount point and not the binds inside it.
    for path in [*interpreter_mounts(), base]:
        wrapper += ["--ro-bind", str(path), str(path)]
    wrapper += ["--size", str(disk_bytes), "--perms", "1777", "--tmpfs", str(work), "--bind", str(io), str(io)]
    for mount in (*PRIVATE_DIRS, "/dev"):  # bwrap's fresh /dev is a writable tmpfs too
        wrapper += ["--remount-ro", mount]
    # The supervisor gets a session of its own, so the harness's killpg of bwrap's group misses it; it still
    # dies with bwrap (--die-with-parent), and the kernel then kills all of its pid namespace.
    wrapper += ["--unshare-net", "--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts",
                "--die-with-parent", "--new-session"]
    for cap in caps:
        wrapper += ["--cap-add", cap]
    return wrapper + ["--"]


def interpreter_mounts() -> list[Path]:
    """Where the interpreter lives, when that is inside a private dir (a checkout or venv under /tmp): the
    top directory below the private dir holding it, bound read-only into the view (keeping its host mode),
    or the sample could not start Python."""
    tops = set()
    for path in {Path(sys.prefix), Path(sys.base_prefix), Path(os.path.realpath(sys.executable))}:
        for private in PRIVATE_DIRS:
            if path.is_relative_to(private) and path != Path(private):
                tops.add(Path(private) / path.relative_to(private).parts[0])
    return sorted(tops)


def unshare_wrapper(pidns: bool) -> list[str]:
    """`unshare`'s command line for the netns layer, and pidns if asked (the fallback without bwrap)."""
    wrapper = [shutil.which("unshare") or "unshare", "--net"]
    if pidns:
        wrapper += ["--pid", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        wrapper.append("--map-root-user")
    return wrapper + ["--"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    passed: bool
    result: str     # "passed", "failed: <last stderr line>", "timed out" or "killed: <signal>"


def run_program(source: str, sandbox: Sandbox, limits: Limits = Limits(), slot: int = 0) -> Outcome:
    """Run `source` as a script (read-only, beside its work dir) in a fresh temp dir, its cwd; it passes iff it
    exits 0 after its last line ran."""
    marker = secrets.token_hex(16)
    base = Path(tempfile.mkdtemp(prefix="llada-sandbox-"))
    try:
        base.chmod(0o711)  # the program's uid must pass through to its work dir
        work, io = base / "work", base / "io"  # the program's cwd; the supervisor's record of its output
        work.mkdir()
        io.mkdir()
        program = base / "program.py"
        program.write_text(f"{source}\nprint({marker!r})\n")
        program.chmod(0o644)  # readable by the program's uid, writable by none but the harness
        if sandbox.drop_uid:
            os.chown(work, UID_BASE + slot, UID_BASE + slot)
        spec = {"command": sandbox.program_command(slot, program), "cwd": str(work), "timeout": limits.timeout_s,
                "env": {**SANDBOX_ENV, "TMPDIR": str(work), "HOME": str(work)},
                "stdout": str(io / "stdout"), "stderr": str(io / "stderr"),
                "rlimits": rlimits(limits, _process_limit(sandbox, limits))}
        status, supervisor_err = _supervise(sandbox.supervisor_command(spec, base, work, io, limits.disk_bytes), limits)
        return judge(status, supervisor_err, _tail(io / "stdout"), _tail(io / "stderr"), marker)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _supervise(command: list[str], limits: Limits) -> tuple[dict | None, str]:
    """Run the supervisor; its status line (None if it died) and its own stderr."""
    supervisor = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  start_new_session=True, env=SANDBOX_ENV)
    try:
        out, err = supervisor.communicate(timeout=limits.timeout_s + BACKSTOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(supervisor.pid, signal.SIGKILL)  # not reaped yet: the group id is still ours
        supervisor.communicate()
        return {"returncode": None, "timed_out": True}, ""
    try:
        return json.loads(out.decode().strip().splitlines()[-1]), err.decode(errors="replace")
    except (IndexError, ValueError):
        return None, err.decode(errors="replace") or f"exit status {supervisor.returncode}"


def rlimits(limits: Limits, processes: int) -> list[tuple[str, int]]:
    """The resource limits the supervisor sets on the program (lowered to any existing hard limit)."""
    return [("RLIMIT_AS", limits.memory_bytes), ("RLIMIT_CPU", math.ceil(limits.timeout_s) + 1),
            ("RLIMIT_NPROC", processes), ("RLIMIT_FSIZE", limits.file_bytes),
            ("RLIMIT_NOFILE", limits.open_files), ("RLIMIT_CORE", 0)]


def _process_limit(sandbox: Sandbox, limits: Limits) -> int:
    """RLIMIT_NPROC counts every process of the uid: a dedicated uid starts at 0, a shared one does not."""
    if sandbox.drop_uid:
        return limits.processes
    return len(_pids_of_uid(os.getuid())) + limits.processes


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            status = Path("/proc", entry, "status").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        uids = next((line.split()[1:2] for line in status.splitlines() if line.startswith("Uid:")), [])
        if uids == [str(uid)]:
            pids.append(int(entry))
    return pids


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - TAIL_BYTES))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def judge(status: dict | None, supervisor_err: str, stdout: str, stderr: str, marker: str) -> Outcome:
    """The outcome from the supervisor's status and the tails of the program's output."""
    if status is None:
        return Outcome(False, f"killed: the sandbox supervisor died ({last_line(supervisor_err)})")
    if status["timed_out"]:
        return Outcome(False, "timed out")
    code = status["returncode"]
    if code < 0:
        return Outcome(False, f"killed: {signal_name(-code)}")
    if code == 0 and stdout.rstrip().endswith(marker):
        return Outcome(True, "passed")
    if code == 0:
        return Outcome(False, "failed: exited before its last line ran")
    return Outcome(False, f"failed: {last_line(stderr) or f'exit status {code}'}")


def last_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
