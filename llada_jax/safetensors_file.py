"""Reading one .safetensors file with plain positioned reads (no JAX, no memory map).

Format: an 8-byte little-endian header length, a JSON header mapping each tensor name to its dtype,
shape and [start, end) byte range in the data section that follows. Reading a tensor with `os.pread`
into a fresh array keeps the file out of the process's resident memory: a memory-mapped shard counts
in RSS as its pages are touched (about 3 GB per LLaDA-8B shard on top of the weights being built).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from llada_jax.errors import LladaError

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
            self.entries, self.data_start = self._header()
        except BaseException:
            os.close(self.fd)
            raise

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
        header.pop("__metadata__", None)
        entries = {}
        for name, entry in header.items():
            entries[name] = self._entry(name, entry, size - 8 - length)
        return entries, 8 + length

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
        dtype, shape, start, end = self.entries[name]
        out = np.empty(shape, DTYPES[dtype])
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < end - start:
            got = os.preadv(self.fd, [view[done:]], self.data_start + start + done)
            if got <= 0:
                raise LladaError(f"{self.path}: tensor {name} cannot be read (file truncated)")
            done += got
        return out

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
