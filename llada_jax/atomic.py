"""Atomic directory writes: build in a temporary sibling directory, then rename into place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


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
