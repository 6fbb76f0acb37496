"""One .safetensors file (no JAX): read, memory-mapped, or written.

Format: an 8-byte little-endian header length, a JSON header mapping each tensor name to its dtype,
shape and [start, end) byte range in the data section that follows, with no holes. `read` copies a tensor
with `os.pread` into a fresh array: a pass over a shard (quantizing, packing stages) then keeps the file out
of the process's resident memory. `mapped` hands out the file's own pages instead, where a tensor's bytes
sit on a 64-byte boundary (what XLA's CPU client needs to use a host buffer in place): weights that are
used as stored then load without a copy, paged in when first used. `write_safetensors` places every
tensor it can on such a boundary.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from llada_jax.system.errors import LladaError
from llada_jax.system.host_cpu import usable_threads
from llada_jax.system.host_memory import ALIGN, aligned_empty

PIECE_BYTES = 16 << 20  # a tensor is read in pieces of at least this many bytes

DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16, "I32": np.int32, "I64": np.int64,
          "I8": np.int8, "U8": np.uint8}
MAX_HEADER = 100_000_000


class SafetensorsFile:
    """An open .safetensors file: `entries` (name -> dtype name, shape, byte range) and `read(name)`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as err:
            raise LladaError(f"{self.path}: cannot open ({err.strerror})") from None
        try:
            self.entries, self.data_start, self.metadata = self._header()
        except BaseException:
            os.close(self.fd)
            raise
        self._pages: np.ndarray | None = None  # the whole file mapped read-only, once `mapped` needs it
        self._readers: ThreadPoolExecutor | None = None  # reads the pieces of a large tensor at once

    def _header(self):
        size = os.fstat(self.fd).st_size
        prefix = os.pread(self.fd, 8, 0)
        if len(prefix) < 8:
            raise self._bad("shorter than a header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER, size - 8):
            raise self._bad(f"header length {length} exceeds the file")
        try:
            header = json.loads(os.pread(self.fd, length, 8))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self._bad("header is not JSON") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        metadata = header.pop("__metadata__", None)
        entries = {}
        for name, entry in header.items():
            entries[name] = self._entry(name, entry, size - 8 - length)
        self._check_tiling(entries, size - 8 - length)
        return entries, 8 + length, metadata if isinstance(metadata, dict) else None

    def _check_tiling(self, entries: dict, data_size: int) -> None:
        """The byte ranges cover the data section exactly, end to end, as the format (and HF's reader) requires:
        two tensors sharing bytes would load as each other's weights."""
        end = 0
        for name, (_, _, start, stop) in sorted(entries.items(), key=lambda item: item[1][2:]):
            if start != end:
                raise self._bad(f"tensor {name}'s bytes {'overlap another' if start < end else 'leave a hole'} "
                                f"(they start at {start}, the tensor before ends at {end})")
            end = stop
        if end != data_size:
            raise self._bad(f"the tensors cover {end} of the data section's {data_size} bytes")

    def _entry(self, name: str, entry, data_size: int):
        try:
            dtype, shape, (start, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise self._bad(f"tensor {name} has a malformed header entry") from None
        if not isinstance(dtype, str) or not all(type(n) is int for n in (*shape, start, end)):
            raise self._bad(f"tensor {name} has a malformed header entry")
        if dtype not in DTYPES:
            raise LladaError(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        nbytes = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
        if min(shape, default=0) < 0 or not 0 <= start <= end <= data_size or end - start != nbytes:
            raise self._bad(f"tensor {name}'s byte range does not match its shape or the file size")
        return dtype, tuple(shape), start, end

    def _bad(self, why: str) -> LladaError:
        return LladaError(f"{self.path}: unreadable safetensors file ({why})")

    def read(self, name: str) -> np.ndarray:
        """A fresh, writable, aligned copy of the tensor; a large one read in pieces, one per usable core at once
        (one thread faulting in the fresh pages and copying them is the slower: eval/RESULTS.md)."""
        dtype, shape, start, end = self.entries[name]
        out = aligned_empty(shape, DTYPES[dtype])
        view = out.reshape(-1).view(np.uint8).data
        readers = min(usable_threads(), max(1, (end - start) // PIECE_BYTES))
        piece = max(1, -(-(end - start) // readers))
        pieces = [(at, view[at: at + piece]) for at in range(0, end - start, piece)]
        if len(pieces) > 1:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(readers, thread_name_prefix="llada-read")
            list(self._readers.map(lambda part: self._fill(name, part[0], part[1], start), pieces))
        elif pieces:
            self._fill(name, *pieces[0], start)
        return out

    def _fill(self, name: str, at: int, view: memoryview, start: int) -> None:
        """Read `view`'s bytes from the tensor starting at `start`, `at` bytes in."""
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], self.data_start + start + at + done)
            if got <= 0:
                raise LladaError(f"{self.path}: tensor {name} cannot be read (file truncated)")
            done += got

    def mapped(self, name: str, dtype=None) -> np.ndarray:
        """The tensor as a read-only view of the file's pages when its bytes are ALIGN-aligned in the file and it
        is stored as `dtype` (None: any), else `read(name)`. A view keeps the mapping alive after `close`;
        the file must not be truncated while one is in use (as with any memory-mapped weights)."""
        stored, shape, start, end = self.entries[name]
        offset = self.data_start + start
        if offset % ALIGN or start == end or (dtype is not None and np.dtype(DTYPES[stored]) != np.dtype(dtype)):
            return self.read(name)
        if self._pages is None:
            self._pages = np.frombuffer(mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ), np.uint8)
        return self._pages[offset: self.data_start + end].view(DTYPES[stored]).reshape(shape)

    def close(self) -> None:
        self._pages = None  # the mapping itself goes when the last view of it does
        if self._readers is not None:
            self._readers.shutdown()
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` as a .safetensors file that any reader accepts, every tensor whose size allows it
    starting on an ALIGN-byte boundary (those sizes first; the header is padded with spaces)."""
    arrays = {name: np.asarray(value, order="C") for name, value in tensors.items()}
    write_tensors(path, {name: (array.dtype, array.shape) for name, array in arrays.items()}, arrays.__getitem__,
                  metadata)


def write_tensors(path: Path, specs: dict[str, tuple], array_of, metadata: dict[str, str] | None = None) -> None:
    """`write_safetensors` for tensors `specs` (name -> (dtype, shape)), each fetched by `array_of(name)` as it
    is written: one in memory at a time."""
    names_by_dtype = {np.dtype(v): k for k, v in DTYPES.items()}
    nbytes = {name: math.prod(shape) * np.dtype(dtype).itemsize for name, (dtype, shape) in specs.items()}
    order = sorted(specs, key=lambda name: nbytes[name] % ALIGN != 0)
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        dtype, shape = specs[name]
        if np.dtype(dtype) not in names_by_dtype:
            raise LladaError(f"{path}: cannot store tensor {name} of dtype {np.dtype(dtype)} in safetensors")
        header[name] = {"dtype": names_by_dtype[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes[name]]}
        offset += nbytes[name]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for name in order:
            array = np.asarray(array_of(name), order="C")
            if array.dtype != np.dtype(specs[name][0]) or array.shape != tuple(specs[name][1]):
                raise LladaError(f"{path}: tensor {name} is not the {specs[name]} announced")
            out.write(array.reshape(-1).view(np.uint8).data)
