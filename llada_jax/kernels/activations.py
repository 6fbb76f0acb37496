"""Activations as the kernels read them (`c/kernels.h`), prepared by ordinary array code in the step itself, so
XLA and IREE bundles hand the kernels the same values: blocks of 32 columns, for 4-bit weights each block's even
columns first (the nibbles' order), block-major (a block of every position contiguous); for int8 kernels,
q = rint(x * (1 / d)) with d = max|x| x (1 / 127) per block (llama.cpp's Q8_0 rule), and each block's sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from llada_jax.kernels.schemes import BLOCK

# d = max|x| x float32(1 / 127): a product, which every compiler keeps as written (a division by a constant
# is one some turn into this product and some do not).
SCALE_PER_MAX = np.float32(1 / 127)


def block_order(x: jax.Array, nibbles: bool) -> jax.Array:
    """x `[R, I]` with each block's even columns first (4-bit weights), else x itself."""
    if not nibbles:
        return x
    positions, columns = x.shape
    return x.reshape(positions, columns // BLOCK, BLOCK // 2, 2).swapaxes(-1, -2).reshape(positions, columns)


def blocks_of(x: jax.Array, nibbles: bool) -> jax.Array:
    """x `[R, I]` block-major, `[I/32, R, 32]` float32, in block order."""
    positions, columns = x.shape
    return block_order(x.astype(jnp.float32), nibbles).reshape(positions, columns // BLOCK, BLOCK).swapaxes(0, 1)


def float_blocks(x: jax.Array) -> jax.Array:
    """Float x `[R, I]` as W4A16 reads it: `[I/32, R, 32]`, each block's even columns first."""
    return blocks_of(x, True)


def quantized(x: jax.Array, nibbles: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(int8 values `[I/32, R, 32]` in block order, float32 scales `[I/32, R]`, int32 sums `[I/32, R]`) of float
    x `[R, I]`."""
    blocks = blocks_of(x, nibbles)
    scale = jnp.max(jnp.abs(blocks), axis=-1) * SCALE_PER_MAX
    inverse = jnp.where(scale > 0, jnp.float32(1) / jnp.where(scale > 0, scale, 1), jnp.float32(0))
    values = jnp.round(blocks * inverse[..., None]).astype(jnp.int8)  # round half to even, as rint
    return values, scale, values.astype(jnp.int32).sum(-1)
