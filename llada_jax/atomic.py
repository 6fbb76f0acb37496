"""Atomic directory writes: build in a temporary sibling directory, then rename into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_dir(out_dir: Path):
    """Yield an empty temporary sibling of `out_dir` to fill; when the block ends without an error it
    becomes `out_dir` (readable like any directory), else it is deleted and `out_dir` is left as it was."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield staging
        publish_permissions(staging)
        replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def replace_dir(staging: Path, out_dir: Path) -> None:
    """Move the complete `staging` directory to `out_dir`; an existing `out_dir` is swapped out only
    once the new one is complete, so a reader sees the old or the new directory, never a mix."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(staging, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out_dir)


def publish_permissions(directory: Path) -> None:
    """mkdtemp makes a private directory; a model directory is readable like any other."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary sibling, flushed to disk, renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
