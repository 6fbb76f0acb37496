"""Quantized weights on the device and the matmuls that consume them.

A `QuantizedWeight` is a pytree leaf pair: integer values (int8, or int4 that XLA stores two per
byte) and float32 scales `[O, G]`. Its matmul never builds a dequantized copy of the whole model:
- per-channel scales (G = 1) multiply the matmul's output: `(x @ q.T) * scale`;
- group-wise scales are applied to the weights of one matrix at a time, inside the step;
- with `activations="int8"` (W8A8, per-channel 8-bit weights only), each position's activations are
  quantized to int8 on the fly (symmetric, one scale per position) and the matmul runs int8 x int8 with
  int32 accumulation, XLA's fastest CPU matmul (measured 150 GFLOP/s at 32 rows x 4096 x 12288 against
  105 for float32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from llada_jax.errors import LladaError
from llada_jax.quantize import HostQuantized

ACTIVATIONS = ("float", "int8")
# The largest float32 copy of one quantized matrix a float-activation matmul makes at once; LLaDA-8B's
# decoder matrices (201 MB at most) are under it, its LM head (2.07 GB) is split into 9 row blocks.
FLOAT_COPY_BYTES = 256 << 20


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    values: jax.Array  # [O, I] int8 or int4
    scale: jax.Array   # [O, G] float32
    activations: str = dataclasses.field(default="float", metadata={"static": True})
    row_block: int = dataclasses.field(default=0, metadata={"static": True})  # rows per float copy (0: all)
    # Group-wise dequantization behind an optimization barrier (see `_float_linear`). XLA needs it; IREE
    # bundles build their weights without it: with it iree-compile failed on LLaDA-8B's 32-layer decode loop
    # ("failed to solve for timepoint coverage").
    hoist_barrier: bool = dataclasses.field(default=True, metadata={"static": True})
    # `values` as stored, unsigned and offset by this much (IREE bundles: undoing the offset in float, after
    # the bit-extend, keeps the integers a pure parameter read; a sign-restoring xor on them is hoisted by
    # iree-compile into a full copy of the weights). 0: `values` are signed.
    offset: int = dataclasses.field(default=0, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape

    @property
    def group_size(self) -> int:
        return self.values.shape[1] // self.scale.shape[1]


def to_device(host: HostQuantized, activations: str = "float", put=jnp.asarray) -> QuantizedWeight:
    """The weight on the device; `put(host_array)` places each part (default: the default device)."""
    if activations not in ACTIVATIONS:
        raise LladaError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    values = host.values if host.scheme.bits == 8 else host.values.astype(jnp.int4)
    return QuantizedWeight(put(values), put(np.asarray(host.scale, np.float32)),
                           host.scheme.matmul_activations(activations), row_block_for(host.shape))


def row_block_for(shape: tuple[int, int]) -> int:
    """Rows per float copy for a float-activation matmul on a matrix of `shape` (0: the whole matrix), on
    XLA and in IREE bundles (LLaDA-8B's 4-bit head unsplit gave a 2.07 GB float copy, and a NaN, there)."""
    rows, columns = shape
    block = max(1, FLOAT_COPY_BYTES // (columns * 4))
    return block if rows > block else 0


def check_activations(activations: str, quantized: dict) -> None:
    """int8 activations need int8 per-channel decoder layers; anywhere else they would be ignored."""
    if activations not in ACTIVATIONS:
        raise LladaError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    blocks = [s for module, s in quantized.items() if ".blocks." in module]
    if activations == "int8" and not (blocks and all(s.matmul_activations("int8") == "int8" for s in blocks)):
        raise LladaError("--activations int8 needs a checkpoint with int8 per-channel layers "
                         "(`llada quantize --bits 8`)")


def restore_sign(offset: jax.Array, bits: int) -> jax.Array:
    """Signed values from compressed-tensors' offset ones read as int4/int8 (`quantize.pack_int32` stores
    v + 2**(bits-1) mod 2**bits, whose two's-complement reading xor the sign bit is v)."""
    return jax.lax.bitwise_xor(offset, jnp.asarray(-(1 << (bits - 1)), offset.dtype))


def offset_values(packed: jax.Array, bits: int, activations: str) -> tuple[jax.Array, int]:
    """(values, offset) of compressed-tensors' offset integers read as int4/int8: for float activations read
    unsigned, the offset undone in float after the bit-extend (IREE bundles: no op on the integers that
    iree-compile would hoist into a copy of every weight); for int8 activations (int8 x int8) signed again."""
    if activations == "int8":
        return restore_sign(packed, bits), 0
    return jax.lax.bitcast_convert_type(packed, UNSIGNED[bits]), 1 << (bits - 1)


UNSIGNED = {4: jnp.uint4, 8: jnp.uint8}


def from_packed_bytes(packed: jax.Array, scale: jax.Array, bits: int, activations: str) -> QuantizedWeight:
    """A QuantizedWeight from a matrix's packed bytes `[O, I * bits / 8]` uint8 (two 4-bit values per
    byte, low nibble first, as XLA's int4 bitcast reads them) and its float32 scales."""
    if bits == 8:
        values = jax.lax.bitcast_convert_type(packed, jnp.int8)
    else:
        values = jax.lax.bitcast_convert_type(packed, jnp.int4).reshape(packed.shape[0], -1)
    return QuantizedWeight(restore_sign(values, bits), scale, activations)


def unpack_stage(weights: dict, quantization) -> dict:
    """A staged stage's tensors with each quantized matrix `(name, bits, activations)` of `quantization`
    rebuilt from its `<name>.values` / `<name>.scale` parts (see `llada_jax.packing.ByteLayout`)."""
    if not quantization:
        return weights
    out = {name: w for name, w in weights.items() if not name.endswith((".values", ".scale"))}
    for name, bits, activations in quantization:
        out[name] = from_packed_bytes(weights[f"{name}.values"], weights[f"{name}.scale"], bits, activations)
    return out


def as_numbers(values: jax.Array, dtype, offset: int = 0) -> jax.Array:
    """Integer `values` as `dtype` numbers, their storage offset undone (exact: small integers)."""
    numbers = values.astype(dtype)
    return numbers - jnp.asarray(offset, dtype) if offset else numbers


def stored_matmul(x: jax.Array, weight: jax.Array, columns: bool = False, offset: int = 0,
                  barrier: bool = True) -> jax.Array:
    """x `[B, W, I]` @ weight `[O, I]`.T in float32, the weight read in the dtype it is stored in. With
    `columns`, x is feature-major `[I, R]` and the product is weight @ x `[O, R]` (`llada_jax.layout`).

    A weight that is not float32 passes through an optimization barrier with x, so whatever XLA derives
    from it (an int8 -> float conversion, a bf16 transpose for its CPU matmul) depends on the step's input
    and cannot be hoisted out of a loop: in the compiled decode loop XLA otherwise built a float32 or
    transposed copy of every weight before the loop (LLaDA-8B: the whole model again). IREE bundles pass
    `barrier=False` (`QuantizedWeight.hoist_barrier`): a barrier there keeps the conversion out of the matmul."""
    if weight.dtype != jnp.float32 and barrier:
        weight, x = jax.lax.optimization_barrier((weight, x))
    return _product(x, as_numbers(weight, x.dtype, offset), columns)


def _product(x: jax.Array, weight: jax.Array, columns: bool) -> jax.Array:
    spec = "oi,ir->or" if columns else "bwi,oi->bwo"
    return jnp.einsum(spec, *((weight, x) if columns else (x, weight)), preferred_element_type=jnp.float32)


def quantized_linear(x: jax.Array, w: QuantizedWeight, columns: bool = False) -> jax.Array:
    """x `[B, W, I]` @ dequantized(w).T, float32 accumulation, in x's dtype. With `columns` (float
    activations only), x is feature-major `[I, R]` and the result dequantized(w) @ x `[O, R]`."""
    if w.activations == "int8":
        if columns:
            raise ValueError("W8A8 matmuls run position-major (llada_jax.layout.LayoutRule.pick)")
        return _int8_linear(x, w)
    if not w.row_block:
        return _float_linear(x, w.values, w.scale, w, columns)
    # The matmul consumes a float copy of the weights: for LLaDA-8B's LM head that is 2 GB at once. Made
    # per block of rows, each copy is freed before the next is made.
    block = w.row_block
    parts = [_float_linear(x, w.values[start:start + block], w.scale[start:start + block], w, columns)
             for start in range(0, w.shape[0], block)]
    return jnp.concatenate(parts, axis=0 if columns else -1)


def _float_linear(x: jax.Array, values: jax.Array, scale: jax.Array, w: QuantizedWeight,
                  columns: bool) -> jax.Array:
    """x @ (values dequantized by `scale`).T; `w` says how the values are stored."""
    if scale.shape[1] == 1:
        product = stored_matmul(x, values, columns, w.offset, w.hoist_barrier)
        return (product * (scale if columns else scale[:, 0])).astype(x.dtype)
    rows, width = values.shape
    groups = scale.shape[1]
    # The float copy depends on x through the barrier, so XLA cannot hoist it out of a loop (the compiled
    # decode loop's while body: LLaDA-8B int4 asked for 30 GB, every weight dequantized at once before it).
    if w.hoist_barrier:
        values, x = jax.lax.optimization_barrier((values, x))
    weight = as_numbers(values, jnp.float32, w.offset).reshape(rows, groups, width // groups) * scale[..., None]
    return _product(x, weight.reshape(rows, width).astype(x.dtype), columns).astype(x.dtype)


def _int8_linear(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    x32 = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    x_scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    x_q = jnp.clip(jnp.round(x32 / x_scale), -127, 127).astype(jnp.int8)
    acc = jnp.einsum("bwi,oi->bwo", x_q, w.values, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * x_scale * w.scale[:, 0]).astype(x.dtype)


def quantized_rows(w: QuantizedWeight, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of a per-row quantized table (the embedding), dequantized to `dtype`."""
    if w.scale.shape[1] != 1:
        raise LladaError("a quantized embedding needs one scale per row")
    return (as_numbers(w.values[ids], jnp.float32, w.offset) * w.scale[ids]).astype(dtype)


def nbytes(leaf) -> int:
    if isinstance(leaf, QuantizedWeight):
        return int(np.prod(leaf.shape)) * jnp.iinfo(leaf.values.dtype).bits // 8 + leaf.scale.nbytes
    return int(leaf.nbytes)
