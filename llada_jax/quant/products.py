"""Float matmuls at the precision their operands' dtype names, on every backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def float_product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, a, b)` accumulated in float32. A float32 operand is multiplied in float32 (HIGHEST): XLA's
    default precision on NVIDIA GPUs is TF32 (10-bit mantissas), which would make `--dtype float32` another
    dtype there than on a CPU and than PyTorch's float32 references. bf16 operands keep the default."""
    exact = jnp.float32 in (a.dtype, b.dtype)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST if exact else None)


def weight_product(x: jax.Array, weight: jax.Array, columns: bool) -> jax.Array:
    """x `[B, W, I]` @ weight `[O, I]`.T, or with `columns` weight @ x `[I, R]` (`llada_jax.model.layout`)."""
    spec = "oi,ir->or" if columns else "bwi,oi->bwo"
    return float_product(spec, *((weight, x) if columns else (x, weight)))
