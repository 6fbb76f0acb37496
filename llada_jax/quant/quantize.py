"""Symmetric integer weight quantization on the host (numpy, no JAX): the math and the int32 packing of
the compressed-tensors "pack-quantized" format.

A matrix `w` `[O, I]` becomes integers `q` (int8 storage, |q| <= 2**(bits-1) - 1) and scales `[O, G]`,
one per output row and group of `group_size` input columns (G = I / group_size; per-channel: G = 1),
with w ≈ q * scale repeated over each group. Scales are rounded to bfloat16 *before* the integers are
chosen, so the stored (bf16) scale is exactly the one the integers were fitted to.

Packing (the convention compressed-tensors, transformers and vLLM read): each value is offset by
2**(bits-1) to make it unsigned, and 32 / bits consecutive values along a row fill one int32, the
first value in the lowest bits; a row's last int32 is zero-padded.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import ml_dtypes
import numpy as np

from llada_jax.system.errors import LladaError
from llada_jax.system.host_memory import aligned_empty

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# What a matmul multiplies its weights with: float activations, or int8 ones quantized per position (W8A8).
Activations = Literal["float", "int8"]


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    bits: int
    group_size: int | None = None  # None: one scale per output channel

    def __post_init__(self):
        if self.bits not in BITS:
            raise LladaError(f"quantization bits must be one of {', '.join(map(str, BITS))}, got {self.bits}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise LladaError(f"quantization group size must be a positive integer, got {self.group_size!r}")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def matmul_activations(self, activations: Activations) -> Activations:
        """The activations a matmul of this scheme runs with: int8 (W8A8) only for per-channel 8-bit weights."""
        return activations if self.bits == 8 and self.group_size is None else "float"

    def groups(self, columns: int) -> int:
        if self.group_size is None:
            return 1
        if columns % self.group_size:
            raise LladaError(f"group size {self.group_size} does not divide a matrix's {columns} input columns")
        return columns // self.group_size


def quantize_matrix(w: np.ndarray, scheme: QuantScheme, name: str = "a matrix") -> tuple[np.ndarray, np.ndarray]:
    """(q int8 `[O, I]`, scale float32 `[O, G]`, bf16-representable). A group with no weight above ~1e-36
    in magnitude gets scale 1 and zeros. A non-finite weight is refused, naming `name`: its group would
    become finite integers and hide it."""
    rows, columns = w.shape
    groups = scheme.groups(columns)
    w = np.asarray(w, np.float32)
    bad = np.flatnonzero(~np.isfinite(w))
    if bad.size:
        index = [int(i) for i in np.unravel_index(bad[0], w.shape)]
        raise LladaError(f"cannot quantize {name}: it holds a non-finite value ({w.reshape(-1)[bad[0]]}) at index "
                         f"{index}, which integers cannot keep (fix the checkpoint)")
    grouped = w.reshape(rows, groups, columns // groups)
    absmax = np.max(np.abs(grouped), axis=-1)
    scale = (absmax / scheme.qmax).astype(ml_dtypes.bfloat16).astype(np.float32)
    # A group too small for a normal bf16 scale (absmax below ~1e-36, all zeros included) is stored as 0s.
    scale = np.where(scale >= ml_dtypes.finfo(ml_dtypes.bfloat16).tiny, scale, np.float32(1.0))
    q = np.clip(np.rint(grouped / scale[..., None]), -scheme.qmax, scheme.qmax).astype(np.int8)
    return q.reshape(rows, columns), scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 `[O, I]` from integers and their `[O, G]` scales."""
    rows, columns = q.shape
    groups = scale.shape[1]
    scale = scale.astype(np.float32, copy=False)
    return (q.reshape(rows, groups, columns // groups).astype(np.float32) * scale[..., None]).reshape(rows, columns)


def packed_words(columns: int, bits: int) -> int:
    """The int32 words a row of `columns` packed `bits`-bit values fills: ceil(columns * bits / 32)."""
    return -(-columns * bits // 32)


def pack_int32(q: np.ndarray, bits: int) -> np.ndarray:
    """int8 values `[O, I]` -> int32 `[O, packed_words(I, bits)]` (see the module docstring). Built as
    little-endian bytes (two 4-bit fields per byte, low nibble first), then read as int32 words."""
    rows, columns = q.shape
    words = packed_words(columns, bits)
    unsigned = np.zeros((rows, words * 32 // bits), np.uint8)
    unsigned[:, :columns] = q.view(np.uint8) + np.uint8(1 << (bits - 1))  # two's complement + 2**(bits-1), mod 256
    packed = unsigned if bits == 8 else unsigned[:, 0::2] | (unsigned[:, 1::2] << np.uint8(4))
    return np.ascontiguousarray(packed).view("<i4").astype(np.int32, copy=False)


def unpack_int32(packed: np.ndarray, bits: int, columns: int) -> np.ndarray:
    """The inverse of `pack_int32`: int8 `[O, columns]`."""
    data = np.ascontiguousarray(packed.astype("<i4", copy=False)).view(np.uint8)
    if bits == 4:
        nibbles = np.empty((data.shape[0], data.shape[1] * 2), np.uint8)
        nibbles[:, 0::2], nibbles[:, 1::2] = data & np.uint8(15), data >> np.uint8(4)
        data = nibbles
    return (data[:, :columns] - np.uint8(1 << (bits - 1))).view(np.int8)


@dataclasses.dataclass(frozen=True)
class HostQuantized:
    """One quantized matrix on the host as a compressed-tensors checkpoint stores it: int32 `words`
    `[O, ceil(I * bits / 32)]` holding `columns` = I values per row, float scales `[O, G]` in their stored dtype."""

    words: np.ndarray
    scale: np.ndarray
    scheme: QuantScheme
    columns: int

    @classmethod
    def of(cls, values: np.ndarray, scale: np.ndarray, scheme: QuantScheme) -> HostQuantized:
        """From int8 values `[O, I]` (as `quantize_matrix` returns them)."""
        return cls(pack_int32(values, scheme.bits), scale, scheme, values.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[0], self.columns

    @property
    def values(self) -> np.ndarray:
        """int8 `[O, I]`, unpacked from the words on each use."""
        return unpack_int32(self.words, self.scheme.bits, self.columns)

    def row_values(self, rows: np.ndarray) -> np.ndarray:
        return unpack_int32(self.words[rows], self.scheme.bits, self.columns)

    def stored_bytes(self) -> np.ndarray:
        """The words' bytes as stored, uint8 `[O, 4 * words]` (the words themselves where they are
        little-endian: a view, no copy)."""
        return np.ascontiguousarray(self.words.astype("<i4", copy=False)).view(np.uint8)

    def signed_bytes(self) -> np.ndarray:
        """The words' bytes less the offset, aligned, uint8 `[O, 4 * words]`: per byte one int8 value (8 bits)
        or two signed nibbles, low first (4 bits); a row's padding last. One pass, no unpacking."""
        data = self.stored_bytes()
        out = aligned_empty(data.shape, np.uint8)
        return np.bitwise_xor(data, np.uint8(0x88 if self.scheme.bits == 4 else 0x80), out=out)

    def rows(self, start: int, count: int) -> HostQuantized:
        """Rows `start` .. `start + count`, zero rows (zero values, zero scales) past the end."""
        words, scale = self.words[start: start + count], self.scale[start: start + count]
        missing = count - words.shape[0]
        if missing > 0:
            words = np.concatenate([words, pack_int32(np.zeros((missing, self.columns), np.int8), self.scheme.bits)])
            scale = np.concatenate([scale, np.zeros((missing, scale.shape[1]), scale.dtype)])
        return HostQuantized(words, scale, self.scheme, self.columns)

    def dequantize(self) -> np.ndarray:
        return dequantize(self.values, self.scale)
