"""A figure saved as a PNG that names the command that drew it, so a later run replaces only its own picture."""

from __future__ import annotations

import io
from pathlib import Path

from llada_jax.system.atomic import atomic_write_bytes, check_output_file


def _signature(command: str) -> bytes:
    return f"llada-jax {command}".encode()


def check_png_target(path, command: str, force: bool) -> None:
    """Refuse, before any work, a `path` that holds anything but an earlier PNG of `command` (that one: with
    `force`)."""
    check_output_file(Path(path), lambda existing: _signature(command) in existing.read_bytes()[:4096], force)


def save_png(figure, path, command: str, force: bool) -> None:
    """Write `figure` to `path` atomically, signed with `command` in its PNG text (the Software field)."""
    check_png_target(path, command, force)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=figure.dpi, metadata={"Software": _signature(command).decode()})
    atomic_write_bytes(Path(path), buffer.getvalue(), command)
