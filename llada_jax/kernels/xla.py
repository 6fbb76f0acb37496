"""The kernels on XLA's CPU path: FFI custom calls, `out[R, O] = x[R, I] @ W.T`, for the weights' schemes W4A8,
W4A16 and W8A8 (`c/kernels.h`), each on activations our own call prepares (`activations`). XLA's own code stays
the fallback (no compiler, another device, a layout the kernels do not take) and the GPU path."""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from llada_jax.kernels import activations
from llada_jax.kernels.build import find_toolchain, xla_library
from llada_jax.system.errors import LladaError

TARGETS = {"llada_int8_activations": "LladaInt8Activations", "llada_float_activations": "LladaFloatActivations",
           "llada_int8_matmul": "LladaInt8Matmul", "llada_float_matmul": "LladaFloatMatmul",
           "llada_int8_routed_matmul": "LladaRoutedInt8Matmul", "llada_float_routed_matmul": "LladaRoutedFloatMatmul"}


@functools.cache
def load() -> str:
    """Builds (first time on this machine) and registers the kernels with XLA; the ISA path they use.
    Raises LladaError without a C compiler or when the build fails."""
    toolchain = find_toolchain()
    if toolchain is None:
        raise LladaError("no C compiler (cc/gcc/clang and c++) on PATH to build the kernels")
    library = xla_library(toolchain, Path(jax.ffi.include_dir()))
    handle = ctypes.CDLL(str(library))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu")
    handle.LladaKernelsIsa.restype = ctypes.c_char_p
    return handle.LladaKernelsIsa().decode()


def available() -> str | None:
    """The ISA path of this machine's kernels, or None after a one-line note on why XLA's code runs instead."""
    try:
        return load()
    except LladaError as error:
        _note_once(f"llada: {error}; quantized matmuls use XLA's code (--kernels compiler)")
        return None


@functools.cache
def _note_once(message: str) -> None:
    print(message, file=sys.stderr)


def matmul(x: jax.Array, stored: jax.Array, scale: jax.Array, scheme: str, signed8: bool = False,
           feature_major: bool = False) -> jax.Array:
    """x `[R, I]` (`[I, R]` when `feature_major`) @ W.T `[R, O]` float32, W's bytes `stored` `[O, I * bits / 8]` as
    `c/kernels.h` reads them and its scales `[O, G]` (float32 or bfloat16); x prepared for the kernel here."""
    attributes = {} if scheme == "w4a16" else {"signed8": signed8}
    return _kernel_call(x, stored, scale, scheme, "", (), attributes, feature_major)


def routed_matmul(x: jax.Array, stored: jax.Array, scale: jax.Array, scheme: str, starts: jax.Array) -> jax.Array:
    """A sparse MoE's routed products `[R, O]` float32: row r of x `[R, I]` times expert e's W.T for the rows
    [starts[e], starts[e + 1]) (the rows sorted by expert, `starts` `[E + 1]` int32), the experts' bytes stacked
    `[E, O, I * bits / 8]` and their scales `[E, O, G]`; each row's value is `matmul`'s, bit for bit."""
    return _kernel_call(x, stored, scale, scheme, "_routed", (starts.astype(jnp.int32),), {})


def _kernel_call(x: jax.Array, stored: jax.Array, scale: jax.Array, scheme: str, variant: str, extra: tuple,
                 attributes: dict, feature_major: bool = False) -> jax.Array:
    """The kernel's custom call (`TARGETS`: `llada_{int8|float}{variant}_matmul`) on x prepared for it, the
    weights' operands, then `extra` operands."""
    positions, columns = activations.positions_columns(x, feature_major)
    group = np.int64(columns // scale.shape[-1])
    if stored.dtype != jnp.int8:  # bytes: a signless i8 tensor in StableHLO (held so: nothing to hoist)
        stored = jax.lax.bitcast_convert_type(stored, jnp.int8)
    out = jax.ShapeDtypeStruct((positions, scale.shape[-2]), jnp.float32)
    nibbles = scheme != "w8a8"
    if scheme == "w4a16":
        blocks = activations.float_blocks(x, feature_major)
        return jax.ffi.ffi_call(f"llada_float{variant}_matmul", out)(blocks, stored, scale, *extra, group=group,
                                                                     **attributes)
    values, block_scales, sums = activations.quantized(x, nibbles, feature_major)
    return jax.ffi.ffi_call(f"llada_int8{variant}_matmul", out)(values, block_scales, sums, stored, scale, *extra,
                                                                bits=np.int64(4 if nibbles else 8), group=group,
                                                                **attributes)


def linear(x: jax.Array, stored: jax.Array, scale: jax.Array, scheme: str, columns: bool = False) -> jax.Array:
    """x `[..., I]` @ W.T by `matmul`, which takes positions as rows; with `columns`, x is feature-major `[I, R]`
    and the result W @ x `[O, R]` (`llada_jax.model.layout`)."""
    out = matmul(x if columns else x.reshape(-1, x.shape[-1]), stored, scale, scheme, feature_major=columns)
    return out.T if columns else out.reshape(*x.shape[:-1], out.shape[-1])
