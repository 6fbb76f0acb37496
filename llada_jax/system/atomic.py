"""Writes that never replace what the user has: an output is built in a temporary sibling and renamed into
place, and only over nothing, an empty directory, or a previous output of the same command (with `force`).

Every output directory carries a marker file naming the command that wrote it, every path it wrote and each
file's size and modification time; that is how a previous output is told apart from the user's own directory,
and how a file the user added to it or edited since is kept: replacing such an output is refused. A target
that is, or contains, one of the command's inputs is refused outright. The temporary siblings are named by
`scratch` (command, host, pid, start time), so a run can remove what a killed run of the same target left
behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from llada_jax.system.errors import LladaError
from llada_jax.system.interrupts import signals_deferred
from llada_jax.system.scratch import remove_stale_scratch, scratch_prefix

MARKER = ".llada-output.json"


def previous_output(path: Path) -> str | None:
    """The command that wrote directory `path` (from its marker), or None."""
    record = _marker(path)
    return record.get("command") if record is not None else None


def _marker(path: Path) -> dict | None:
    try:
        record = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _contents(directory: Path) -> list[str]:
    """Every path under `directory` (files, folders, links), relative to it, but the marker."""
    found = []
    for root, folders, files in os.walk(directory):
        for name in folders + files:
            found.append(os.path.relpath(os.path.join(root, name), directory))
    return sorted(path for path in found if path != MARKER)


def _added_since(out_dir: Path, fresh: list[str] | None) -> list[str]:
    """What `out_dir` holds that the command did not write. An output of an older llada did not list its
    files: there, what the new output (`fresh`, once written) does not replace by name."""
    written = (_marker(out_dir) or {}).get("contents")
    if not isinstance(written, list):
        written = _contents(out_dir) if fresh is None else fresh  # known only once the new output is written
    return sorted(set(_contents(out_dir)) - set(written))


def check_output_dir(out_dir: Path, command: str, inputs=(), force: bool = False,
                     fresh: list[str] | None = None) -> bool:
    """Refuse, in one line, a target whose writing could destroy something the user has; say whether it holds an
    earlier output that the write replaces (`fresh`: the paths of the new output, once written)."""
    out_dir = Path(out_dir)
    target = out_dir.resolve()
    for source in inputs:
        source = Path(source).resolve()
        if target == source or target in source.parents or source in target.parents:
            relation = "is" if target == source else "contains" if target in source.parents else "is inside"
            raise LladaError(f"{out_dir} {relation} this command's input {source}; choose an output directory of "
                             "its own, outside it")
    if not out_dir.exists() and not out_dir.is_symlink():
        return False
    if out_dir.is_symlink():
        raise LladaError(f"{out_dir} is a symbolic link; refusing to write through or over it (give a real directory)")
    if not out_dir.is_dir():
        raise LladaError(f"{out_dir} exists and is not a directory; refusing to replace it")
    if not any(out_dir.iterdir()):
        return False
    writer = previous_output(out_dir)
    if writer != command:
        what = f"an output of `{writer}`" if writer else "not an output of this command"
        raise LladaError(f"{out_dir} is not empty and is {what}; refusing to replace it (choose a new directory)")
    if not force:
        raise LladaError(f"{out_dir} holds an earlier output of `{command}`; pass --force to replace it")
    added = _added_since(out_dir, fresh)
    if added:
        raise LladaError(f"{out_dir} holds an earlier output of `{command}` and also what it did not write "
                         f"({_first(added)}); move that out before --force replaces the output")
    edited = _edited_since(out_dir)
    if edited:
        raise LladaError(f"{out_dir} holds an earlier output of `{command}` with files changed since it wrote them "
                         f"({_first(edited)}); move them out before --force replaces the output")
    return True


def _first(paths: list[str]) -> str:
    return f"{', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}"


def _stamps(directory: Path, paths: list[str]) -> dict[str, list[int]]:
    """Size and modification time of each regular file among `paths` (what an edit changes)."""
    stamps = {}
    for path in paths:
        status = os.lstat(directory / path)
        if stat.S_ISREG(status.st_mode):
            stamps[path] = [status.st_size, status.st_mtime_ns]
    return stamps


def _edited_since(out_dir: Path) -> list[str]:
    """The files of an earlier output whose size or modification time is not what its marker recorded."""
    recorded = (_marker(out_dir) or {}).get("stamps")
    if not isinstance(recorded, dict):
        return []  # an older llada's output: it recorded none
    present = _stamps(out_dir, [path for path in recorded if os.path.lexists(out_dir / path)])
    return sorted(path for path, stamp in present.items() if stamp != recorded[path])


@contextlib.contextmanager
def atomic_dir(out_dir: Path, command: str, inputs=(), force: bool = False):
    """Yield an empty temporary sibling of `out_dir` to fill; when the block ends without an error it is
    marked as `command`'s output and becomes `out_dir`, else it is deleted and `out_dir` is left as it was.
    `check_output_dir` runs before anything is written and again just before the swap."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, command, inputs, force)
    with scratch_dir(out_dir, command) as staging:  # renamed into place, or removed when the block fails
        yield staging
        fresh = _contents(staging)
        record = {"command": command, "contents": fresh, "stamps": _stamps(staging, fresh)}
        (staging / MARKER).write_text(json.dumps(record) + "\n")
        publish_permissions(staging)
        replacing = check_output_dir(out_dir, command, inputs, force, fresh)
        replace_dir(staging, out_dir, command, replacing)


@contextlib.contextmanager
def scratch_dir(target: Path, command: str):
    """Yield a scratch sibling of `target` for the files a write of it needs on the way; it is removed when the
    block ends (unless the block moved it), and by a later write of `target` if this process is killed first."""
    target = Path(target)
    with _named_as(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_scratch(target)
    path = None
    try:
        with signals_deferred(), _named_as(target):  # a signal between the mkdir and the assignment: unknown here
            path = _new_scratch_dir(target, command)
        yield path
    finally:
        if path is not None:
            remove_scratch(path)


def _new_scratch_dir(target: Path, command: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=scratch_prefix(target, command), dir=target.parent))


@contextlib.contextmanager
def _named_as(target: Path):
    """A place where nothing can be written is named as the user gave it, not by a hidden scratch name."""
    try:
        yield
    except OSError as err:
        raise LladaError(f"cannot write {target}: {err.strerror or err}") from None


def write_once(out: Path, complete, write) -> Path:
    """A cache entry written at most once: `write()` (an atomic write of `out`) unless `complete(out)`. When
    another process publishes the same entry first, the atomic write refuses to replace it; that entry is kept and
    this one's copy, still in scratch, is discarded."""
    if not complete(out):
        try:
            write()
        except LladaError:
            if not complete(out):
                raise
    return out


def replace_dir(staging: Path, out_dir: Path, command: str, replacing: bool) -> None:
    """Move the complete `staging` directory to `out_dir`. An earlier output (`replacing`, checked by the caller)
    is swapped out only once the new one is complete, so a reader sees the old or the new directory, never a mix;
    it waits in a scratch sibling, which a later run removes if this one is killed first. Otherwise the rename
    fails, rather than replace it, on whatever another process put at `out_dir` since the check."""
    if not replacing:
        try:
            os.rename(staging, out_dir)  # onto nothing or an empty directory; refused on anything else
        except OSError as error:
            if not (out_dir.exists() or out_dir.is_symlink()):
                raise
            raise LladaError(f"{out_dir} was written by another process meanwhile; it is left as it is") from error
    else:
        _swap(staging, out_dir, command)


def _swap(staging: Path, out_dir: Path, command: str) -> None:
    """`staging` in the place of the earlier output at `out_dir`, which is then removed."""
    old = None
    try:
        with signals_deferred():  # the earlier output is never left moved aside without the new one in place
            old = _new_scratch_dir(out_dir, command)
            os.replace(out_dir, old / "replaced")
            try:
                os.replace(staging, out_dir)
            except OSError:
                os.replace(old / "replaced", out_dir)
                raise
    finally:
        if old is not None:
            remove_scratch(old)


def remove_scratch(path: Path | str) -> None:
    """Remove this run's scratch `path` whole: a signal arriving meanwhile waits until it is gone."""
    path = Path(path)
    with signals_deferred():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def publish_permissions(directory: Path) -> None:
    """mkdtemp makes a private directory; an output is readable like any other (executables stay executable)."""
    umask = _umask()
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod((0o777 if path.stat().st_mode & 0o100 else 0o666) & ~umask)


def check_output_file(path: Path, is_previous_output, force: bool = False) -> None:
    """Refuse an existing `path` unless `is_previous_output(path)` and `force`."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_file() or not is_previous_output(path):
        raise LladaError(f"{path} exists and is not an output of this command; refusing to replace it")
    if not force:
        raise LladaError(f"{path} holds an earlier output of this command; pass --force to replace it")


def atomic_write_bytes(path: Path, data: bytes, command: str) -> None:
    """Write `path` whole or not at all: a temporary sibling, flushed to disk, renamed over it. The caller
    has checked that `path` may be replaced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_scratch(path)
    staging = None
    try:
        with signals_deferred():  # as in atomic_dir: the file is never made without its name being known
            handle, staging = tempfile.mkstemp(prefix=scratch_prefix(path, command), dir=path.parent)
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(staging, 0o666 & ~_umask())  # mkstemp's file is private
        os.replace(staging, path)
    except BaseException:
        if staging is not None:
            remove_scratch(staging)
        raise
