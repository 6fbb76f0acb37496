"""A figure saved as a PNG that names the command that drew it, so a later run replaces only its own picture."""

from __future__ import annotations

import io
import struct
from pathlib import Path

from llada_jax.system.atomic import atomic_write_bytes, check_output_file

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _signature(command: str) -> bytes:
    return f"llada-jax {command}".encode()


def png_software(path: Path) -> bytes | None:
    """The Software text of the PNG at `path`, read from the chunks before its image data; None when the file
    is not a PNG or has none. Only those first chunks are read, whatever the file's size."""
    with open(path, "rb") as handle:
        if handle.read(8) != PNG_SIGNATURE:
            return None
        while len(header := handle.read(8)) == 8:
            length, kind = struct.unpack(">I4s", header)
            if kind in (b"IDAT", b"IEND") or length > 2**20:
                return None
            data = handle.read(length)
            handle.seek(4, io.SEEK_CUR)  # its CRC
            if kind == b"tEXt" and data.startswith(b"Software\0"):
                return data.removeprefix(b"Software\0")
    return None


def check_png_target(path, command: str, force: bool) -> None:
    """Refuse, before any work, a `path` that holds anything but an earlier PNG of `command` (that one: with
    `force`)."""
    check_output_file(Path(path), lambda existing: png_software(existing) == _signature(command), force)


def save_png(figure, path, command: str, force: bool) -> None:
    """Write `figure` to `path` atomically, signed with `command` in its PNG text (the Software field)."""
    check_png_target(path, command, force)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=figure.dpi, metadata={"Software": _signature(command).decode()})
    atomic_write_bytes(Path(path), buffer.getvalue(), command)
