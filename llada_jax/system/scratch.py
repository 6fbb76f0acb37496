"""Scratch siblings: where a write is built before it is renamed into place. Each one's name is its marker:

    .<target name>.llada-scratch.<command>.<host>.<pid>.<start time>.<random>

so a later run of any writing command can tell, without opening it, that it is scratch of the same target
left by a process that is gone (killed: SIGKILL cannot be caught), and remove it. Scratch of another target,
of a live process, of another host (its processes cannot be seen from here) or anything not named this way
is never touched."""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from pathlib import Path

TAG = "llada-scratch"
_FIELDS = re.compile(r"(?P<command>[a-z0-9-]+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.(?P<start>\d+)\.[a-z0-9_]{8}")


def _slug(text: str, keep: str = "a-z0-9") -> str:
    return re.sub(rf"[^{keep}]+", "-", text).strip("-")[:40] or "unknown"


def _host() -> str:
    return _slug(socket.gethostname(), "A-Za-z0-9")


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the third (state) on; none where the system has no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2:].split()  # after the command's name, which may hold spaces


def process_start(pid: int) -> int:
    """The process's start time in clock ticks since boot (Linux), so a reused pid is not taken for the
    writer; 0 where the system does not say."""
    fields = _stat(pid)
    return int(fields[19]) if fields else 0  # field 22


def _alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    fields = _stat(pid)
    if not fields:
        return True
    return fields[0] != "Z" and (start == 0 or int(fields[19]) == start)  # a zombie writes nothing more


def scratch_prefix(target: Path, command: str) -> str:
    """The name prefix of this process's scratch for `target` (tempfile adds the random part)."""
    return f".{Path(target).name}.{TAG}.{_slug(command.lower())}.{_host()}.{os.getpid()}.{process_start(os.getpid())}."


def stale_scratch(target: Path) -> list[Path]:
    """The scratch siblings of `target` whose writing process, on this host, is gone."""
    target = Path(target)
    prefix, host = f".{target.name}.{TAG}.", _host()
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    stale = []
    for name in names:
        fields = _FIELDS.fullmatch(name[len(prefix):]) if name.startswith(prefix) else None
        if fields and fields["host"] == host and not _alive(int(fields["pid"]), int(fields["start"])):
            stale.append(target.parent / name)
    return sorted(stale)


def _size(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(os.lstat(os.path.join(root, name)).st_size for root, _, names in os.walk(path) for name in names)


def remove_stale_scratch(target: Path) -> tuple[int, int]:
    """Remove what killed runs left beside `target`, saying so in one line on stderr: (count, bytes)."""
    removed = size = 0
    for path in stale_scratch(target):
        try:
            size += _size(path)
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            removed += 1
        except FileNotFoundError:  # another run removed it first
            continue
    if removed:
        print(f"llada: removed {removed} scratch {'copy' if removed == 1 else 'copies'} of {target} left by "
              f"killed runs ({size / 1e6:.1f} MB)", file=sys.stderr)
    return removed, size
