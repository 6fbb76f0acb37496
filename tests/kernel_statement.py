"""The arithmetic of our kernels (`llada_jax/kernels/c/kernels.h`) stated in numpy, and a ctypes caller for a
kernels library built with any ISA flags."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

BLOCK = 32
F32 = np.float32


class Weights(ctypes.Structure):
    _fields_ = [("weights", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("rows", ctypes.c_int64),
                ("columns", ctypes.c_int64), ("group", ctypes.c_int64), ("scale_bf16", ctypes.c_int32),
                ("signed8", ctypes.c_int32)]


class Int8Activations(ctypes.Structure):
    _fields_ = [("values", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("sums", ctypes.c_void_p),
                ("positions", ctypes.c_int64)]


def block_order(x: np.ndarray, nibbles: bool) -> np.ndarray:
    """`x [..., I]` as `[..., I/32, 32]` blocks, in the order the kernels read them (4-bit: even columns first)."""
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    return np.concatenate([blocks[..., 0::2], blocks[..., 1::2]], -1) if nibbles else blocks


def quantize_activations(x: np.ndarray, nibbles: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 values `[R, I/32, 32]` (block order), scales and sums `[R, I/32]`: q = rint(x * (1/d)),
    d = max|x| x float32(1/127), all in float32."""
    blocks = block_order(x.astype(F32), nibbles)
    d = (np.abs(blocks).max(-1) * F32(1 / 127)).astype(F32)
    inverse = np.divide(F32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(blocks * inverse[..., None]).astype(np.int8)
    return q, d, q.astype(np.int32).sum(-1, dtype=np.int32)


def block_sums(q: np.ndarray, values: np.ndarray, nibbles: bool) -> np.ndarray:
    """The exact int32 sums per (position, row, block) of int8 activations with signed weight values `[O, I]`."""
    w = block_order(values, nibbles).astype(np.int64)
    return np.einsum("rbj,obj->rob", q.astype(np.int64), w)


def int8_result(x: np.ndarray, values: np.ndarray, scales: np.ndarray, nibbles: bool) -> np.ndarray:
    """W4A8 / W8A8: sum over blocks of (int32 block sum) x d(position, block) x scale(row, group), float64."""
    q, d, _ = quantize_activations(x, nibbles)
    per_block = np.repeat(scales.astype(np.float64), values.shape[1] // scales.shape[1] // BLOCK, axis=1)
    return np.einsum("rob,rb,ob->ro", block_sums(q, values, nibbles).astype(np.float64), d.astype(np.float64),
                     per_block)


def float_result(x: np.ndarray, values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """W4A16: x @ (values x scale, each rounded to float32).T in float64."""
    group = values.shape[1] // scales.shape[1]
    weight = (values.reshape(values.shape[0], -1, group) * scales.astype(F32)[..., None]).astype(F32)
    return x.astype(np.float64) @ weight.reshape(values.shape).astype(np.float64).T


def pack4(values: np.ndarray) -> np.ndarray:
    """Signed 4-bit values `[O, I]` as stored: bytes `[O, I/2]`, value + 8, low nibble first."""
    offset = (values + 8).astype(np.uint8)
    return offset[:, 0::2] | (offset[:, 1::2] << 4)


def pack8(values: np.ndarray, signed8: bool) -> np.ndarray:
    return values.astype(np.int8).view(np.uint8) if signed8 else (values + 128).astype(np.uint8)


def _ptr(array: np.ndarray) -> int:
    return array.ctypes.data


def run(library: Path, scheme: str, x: np.ndarray, stored: np.ndarray, scales: np.ndarray,
        signed8: bool = False) -> np.ndarray:
    """The library's kernel `scheme` on float32 x `[R, I]` (prepared as stated here), the weights' bytes and
    scales (float32 or bfloat16 `[O, G]`), rows split in two calls as threads would."""
    lib = ctypes.CDLL(str(library))
    positions, columns = x.shape
    rows = stored.shape[0]
    w = Weights(_ptr(stored), _ptr(scales), rows, columns, columns // scales.shape[1], int(scales.dtype != F32),
                int(signed8))
    out = np.full((positions, rows), np.nan, F32)
    halves = [(0, rows // 2), (rows // 2, rows)]
    if scheme == "w4a16":
        ordered = np.ascontiguousarray(block_order(x.astype(F32), True).reshape(positions, columns))
        for begin, end in halves:
            lib.llk_w4a16(ctypes.byref(w), ctypes.c_void_p(_ptr(ordered)), ctypes.c_int64(positions),
                          ctypes.c_void_p(_ptr(out)), ctypes.c_int64(begin), ctypes.c_int64(end))
        return out
    values, block_scales, sums = (np.ascontiguousarray(a) for a in quantize_activations(x, scheme == "w4a8"))
    a = Int8Activations(_ptr(values), _ptr(block_scales), _ptr(sums), positions)
    for begin, end in halves:
        getattr(lib, f"llk_{scheme}")(ctypes.byref(w), ctypes.byref(a), ctypes.c_void_p(_ptr(out)),
                                      ctypes.c_int64(begin), ctypes.c_int64(end))
    return out
