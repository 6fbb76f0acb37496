"""The arithmetic of our kernels (`llada_jax/kernels/c/kernels.h`) stated in numpy, and two callers: ctypes for a
kernels library built for this CPU with any ISA flags, `kernel_runner.c` for a build for another (arm64)."""

from __future__ import annotations

import ctypes
import dataclasses
import subprocess
import tempfile
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
                ("positions", ctypes.c_int64), ("total", ctypes.c_int64)]


def block_order(x: np.ndarray, nibbles: bool) -> np.ndarray:
    """`x [..., I]` as `[..., I/32, 32]` blocks, in the order the kernels read them (4-bit: even columns first)."""
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    return np.concatenate([blocks[..., 0::2], blocks[..., 1::2]], -1) if nibbles else blocks


def quantize_activations(x: np.ndarray, nibbles: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 values `[R, I/32, 32]` (block order), scales and sums `[R, I/32]`: q = rint(x * (1/d)),
    d = max|x| x float32(1/127), all in float32 (1/d taken as 0 where d is 0 or 1/d is not finite)."""
    blocks = block_order(x.astype(F32), nibbles)
    d = (np.abs(blocks).max(-1) * F32(1 / 127)).astype(F32)
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.divide(F32(1), d, out=np.zeros_like(d), where=d > 0)
    inverse[~np.isfinite(inverse)] = 0
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


SCHEMES = ("w4a8", "w8a8", "w4a16")  # kernel_runner.c's numbering


@dataclasses.dataclass(frozen=True)
class Call:
    """One kernel call's operands as the kernels take them: the weights' bytes and scales, then the int8
    activations (values, scales, sums) or the float ones, all block-major, in block order."""
    scheme: str
    positions: int
    rows: int
    columns: int
    group: int
    scale_bf16: bool
    signed8: bool
    arrays: tuple[np.ndarray, ...]

    def header(self) -> np.ndarray:
        return np.array([SCHEMES.index(self.scheme), self.positions, self.rows, self.columns, self.group,
                         self.scale_bf16, self.signed8], np.int64)


def prepare(scheme: str, x: np.ndarray, stored: np.ndarray, scales: np.ndarray, signed8: bool = False) -> Call:
    """The call of kernel `scheme` on float32 x `[R, I]` (prepared as stated here), the weights' bytes and scales
    (float32 or bfloat16 `[O, G]`)."""
    positions, columns = x.shape
    if scheme == "w4a16":
        activations = (block_order(x.astype(F32), True),)
    else:
        activations = quantize_activations(x, scheme == "w4a8")
    activations = tuple(a.swapaxes(0, 1) for a in activations)  # block-major: [I/32, R, 32] and [I/32, R]
    arrays = tuple(np.ascontiguousarray(a) for a in (stored, scales, *activations))
    return Call(scheme, positions, stored.shape[0], columns, columns // scales.shape[1], scales.dtype != F32,
                signed8, arrays)


def _ptr(array: np.ndarray) -> int:
    return array.ctypes.data


def halves(rows: int) -> list[tuple[int, int]]:
    """The rows split in two calls, as threads would."""
    return [(0, rows // 2), (rows // 2, rows)]


def run(library: Path, scheme: str, x: np.ndarray, stored: np.ndarray, scales: np.ndarray,
        signed8: bool = False) -> np.ndarray:
    """The library's kernel `scheme` on the call `prepare` states, through ctypes."""
    lib = ctypes.CDLL(str(library))
    call = prepare(scheme, x, stored, scales, signed8)
    weights, weight_scales, *activations = call.arrays
    w = Weights(_ptr(weights), _ptr(weight_scales), call.rows, call.columns, call.group, int(call.scale_bf16),
                int(signed8))
    out = np.full((call.positions, call.rows), np.nan, F32)
    if scheme == "w4a16":
        for begin, end in halves(call.rows):
            lib.llk_w4a16(ctypes.byref(w), ctypes.c_void_p(_ptr(activations[0])), ctypes.c_int64(call.positions),
                          ctypes.c_int64(call.positions), ctypes.c_void_p(_ptr(out)), ctypes.c_int64(begin),
                          ctypes.c_int64(end))
        return out
    a = Int8Activations(*map(_ptr, activations), call.positions, call.positions)
    for begin, end in halves(call.rows):
        getattr(lib, f"llk_{scheme}")(ctypes.byref(w), ctypes.byref(a), ctypes.c_void_p(_ptr(out)),
                                      ctypes.c_int64(begin), ctypes.c_int64(end))
    return out


def run_program(command: list[str], scheme: str, x: np.ndarray, stored: np.ndarray, scales: np.ndarray,
                signed8: bool = False) -> tuple[np.ndarray, str]:
    """The kernel `scheme` through `kernel_runner.c` built for another CPU (`command`: how to run it, e.g. under
    qemu): (the output, the ISA path its build names)."""
    call = prepare(scheme, x, stored, scales, signed8)
    with tempfile.TemporaryDirectory() as work:
        request, answer = Path(work) / "call.bin", Path(work) / "out.bin"
        request.write_bytes(b"".join(a.tobytes() for a in (call.header(), *call.arrays)))
        done = subprocess.run([*command, str(request), str(answer)], capture_output=True, text=True, check=True)
        return np.fromfile(answer, F32).reshape(call.positions, call.rows), done.stdout.strip()


class FloatInput(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("positions", ctypes.c_int64), ("columns", ctypes.c_int64),
                ("feature_major", ctypes.c_int32), ("nibbles", ctypes.c_int32)]


def preparation_shapes(positions: int, columns: int, int8: bool) -> list[tuple[tuple[int, ...], type]]:
    """What `c/activations.c` writes: for int8 kernels values `[I/32, R, 32]`, scales and sums `[I/32, R]`; for
    W4A16 the float blocks `[I/32, R, 32]`."""
    blocks = columns // BLOCK
    if not int8:
        return [((blocks, positions, BLOCK), F32)]
    return [((blocks, positions, BLOCK), np.int8), ((blocks, positions), F32), ((blocks, positions), np.int32)]


def prepare_with_library(library: Path, x: np.ndarray, feature_major: bool, nibbles: bool,
                         int8: bool) -> list[np.ndarray]:
    """The library's preparation (`c/activations.c`) of float32 x `[R, I]`, held feature-major `[I, R]` when asked,
    its blocks in two calls: the int8 values, scales and sums, or the float blocks `[I/32, R, 32]`."""
    lib = ctypes.CDLL(str(library))
    positions, columns = x.shape
    held = np.ascontiguousarray(x.T if feature_major else x, F32)
    given = FloatInput(_ptr(held), positions, columns, int(feature_major), int(nibbles))
    shapes = preparation_shapes(positions, columns, int8)
    outs = [np.zeros(shape, dtype) for shape, dtype in shapes]
    blocks, function = columns // BLOCK, lib.llk_int8_blocks if int8 else lib.llk_float_blocks
    for begin, end in ((0, blocks // 2), (blocks // 2, blocks)):
        function(ctypes.byref(given), *(ctypes.c_void_p(_ptr(out)) for out in outs), ctypes.c_int64(begin),
                 ctypes.c_int64(end))
    return outs


def prepare_with_program(command: list[str], x: np.ndarray, feature_major: bool, nibbles: bool,
                         int8: bool) -> list[np.ndarray]:
    """`prepare_with_library` through `kernel_runner.c` built for another CPU (`command`, e.g. under qemu)."""
    positions, columns = x.shape
    held = np.ascontiguousarray(x.T if feature_major else x, F32)
    header = np.array([3, positions, 0, columns, feature_major, nibbles, int8], np.int64)
    shapes = preparation_shapes(positions, columns, int8)
    with tempfile.TemporaryDirectory() as work:
        request, answer = Path(work) / "call.bin", Path(work) / "out.bin"
        request.write_bytes(header.tobytes() + held.tobytes())
        subprocess.run([*command, str(request), str(answer)], capture_output=True, text=True, check=True)
        data, outs = answer.read_bytes(), []
        for shape, dtype in shapes:
            count = int(np.prod(shape))
            outs.append(np.frombuffer(data, dtype, count).reshape(shape))
            data = data[count * np.dtype(dtype).itemsize:]
        return outs
