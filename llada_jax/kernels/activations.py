"""Activations as the kernels read them (`c/kernels.h`), prepared by our own call in the step (`c/activations.c`),
so XLA and IREE bundles hand the kernels the same values: blocks of 32 columns, for 4-bit weights each block's
even columns first (the nibbles' order), block-major (a block of every position contiguous); for int8 kernels,
q = rint(x * (1 / d)) with d = max|x| x (1 / 127) per block (llama.cpp's Q8_0 rule), and each block's sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llada_jax.kernels.schemes import BLOCK


def positions_columns(x: jax.Array, feature_major: bool) -> tuple[int, int]:
    """(R, I) of x `[R, I]`, or of x `[I, R]` when `feature_major`."""
    positions, columns = x.shape[::-1] if feature_major else x.shape
    return positions, columns


def float_blocks(x: jax.Array, feature_major: bool = False) -> jax.Array:
    """x as W4A16 reads it: `[I/32, R, 32]` float32, each block's even columns first."""
    positions, columns = positions_columns(x, feature_major)
    blocks = columns // BLOCK
    out = jax.ShapeDtypeStruct((blocks, positions, BLOCK), jnp.float32)
    return jax.ffi.ffi_call("llada_float_activations", out)(x.astype(jnp.float32), feature_major=feature_major)


def quantized(x: jax.Array, nibbles: bool, feature_major: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(int8 values `[I/32, R, 32]` in block order, float32 scales `[I/32, R]`, int32 sums `[I/32, R]`) of x."""
    positions, columns = positions_columns(x, feature_major)
    blocks = columns // BLOCK
    out = (jax.ShapeDtypeStruct((blocks, positions, BLOCK), jnp.int8),
           jax.ShapeDtypeStruct((blocks, positions), jnp.float32), jax.ShapeDtypeStruct((blocks, positions), jnp.int32))
    values, scales, sums = jax.ffi.ffi_call("llada_int8_activations", out)(
        x.astype(jnp.float32), feature_major=feature_major, nibbles=nibbles)
    return values, scales, sums
