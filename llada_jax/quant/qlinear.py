"""Quantized weights on the device and the matmuls that consume them.

A `QuantizedWeight` is a pytree leaf pair: integer values (int8, or 4-bit two per byte) and float32
scales `[O, G]`. Its matmul never builds a dequantized copy of the whole model:
- per-channel scales (G = 1) multiply the matmul's output: `(x @ q.T) * scale`;
- group-wise scales are applied to the weights of a few rows of one matrix at a time, inside the step;
- with `activations="int8"` (W8A8, per-channel 8-bit weights only), each position's activations are
  quantized to int8 on the fly (symmetric, one scale per position) and the matmul runs int8 x int8 with
  int32 accumulation, XLA's fastest CPU matmul (measured 150 GFLOP/s at 32 rows x 4096 x 12288 against
  105 for float32).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from llada_jax.kernels import xla as own_kernels
from llada_jax.kernels.schemes import scheme_for
from llada_jax.quant.choice import ACTIVATIONS, Kernels
from llada_jax.quant.products import weight_product
from llada_jax.quant.quantize import Activations, HostQuantized, QuantScheme
from llada_jax.system.errors import LladaError

# The largest float32 copy of one quantized matrix a float-activation matmul makes at once in an IREE bundle;
# LLaDA-8B's decoder matrices (201 MB at most) are under it, its LM head (2.07 GB) is split into 9 row blocks.
FLOAT_COPY_BYTES = 256 << 20
# On XLA the copy is made a few rows at a time in a loop over the matrix: a small copy stays in the cache and
# reuses its memory, where a whole-matrix copy is a fresh mapping written and read back from RAM each step.
LOOP_COPY_BYTES = 16 << 20


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    values: jax.Array  # [O, I] int8 or int4, or with `nibbles` [O, I / 2] uint8
    scale: jax.Array   # [O, G] float, as stored (bf16 scales converted to float32 a few rows at a time)
    activations: Activations = dataclasses.field(default="float", metadata={"static": True})
    row_block: int = dataclasses.field(default=0, metadata={"static": True})  # rows per float copy (0: all)
    # XLA's form (see `quantized_linear`): group-wise dequantization behind an optimization barrier, in a loop
    # over row blocks. IREE bundles build their weights without it: with the barrier iree-compile failed on
    # LLaDA-8B's 32-layer decode loop ("failed to solve for timepoint coverage").
    hoist_barrier: bool = dataclasses.field(default=True, metadata={"static": True})
    # `values` as stored, unsigned and offset by this much (IREE bundles: undoing the offset in float, after
    # the bit-extend, keeps the integers a pure parameter read; a sign-restoring xor on them is hoisted by
    # iree-compile into a full copy of the weights). 0: `values` are signed.
    offset: int = dataclasses.field(default=0, metadata={"static": True})
    # 4-bit values as bytes, two each, low nibble first (XLA: its int4 arrays are read one element at a time,
    # bytes split by shifts are vectorized). With an offset (8), the checkpoint's own bytes, used in place:
    # the split restores the sign with an xor on the few rows it reads.
    nibbles: bool = dataclasses.field(default=False, metadata={"static": True})
    # Our kernel for this matrix ("w4a8", "w4a16", "w8a8"; `values` the bytes as stored), or "": XLA's code.
    kernel: str = dataclasses.field(default="", metadata={"static": True})

    @property
    def shape(self) -> tuple[int, int]:
        rows, columns = self.values.shape
        return (rows, 2 * columns) if self.nibbles else (rows, columns)

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scale.shape[1]


def to_device(host: HostQuantized, activations: Activations = "float", put=jnp.asarray,
              kernels: Kernels = "compiler") -> QuantizedWeight:
    """The weight on the device for XLA; `put(host_array)` places each part (default: the default device).
    With `kernels="own"` (built: `own_kernels.available()`), a matrix one of them takes keeps its stored bytes."""
    if activations not in ACTIVATIONS:
        raise LladaError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    bits = host.scheme.bits
    kernel = scheme_for(bits, activations, host.shape[1], host.shape[1] // host.scale.shape[1])
    if kernels == "own" and kernel:  # the bytes as int8, the type the kernels' calls take: no op on the weights
        values = host.stored_bytes()[:, :host.shape[1] * bits // 8].view(np.int8)
        return QuantizedWeight(put(values), put(host.scale), activations, offset=1 << (bits - 1),
                               nibbles=bits == 4, kernel=kernel)
    nibbles = host.scheme.bits == 4 and _splits_in_nibbles(host.shape, host.scale.shape)
    width, offset = host.shape[1] // 2 if nibbles else host.shape[1], 0
    if uses_stored_words(host.scheme, activations) and (nibbles or host.scheme.bits == 8):
        values, offset = host.stored_bytes()[:, :width], 1 << (host.scheme.bits - 1)
    elif host.scheme.bits == 8:
        values = host.signed_bytes()[:, :width].view(np.int8)
    else:
        values = host.values.astype(jnp.int4)
    return QuantizedWeight(put(values), put(host.scale),
                           host.scheme.matmul_activations(activations), xla_row_block(host.shape, values.dtype),
                           offset=offset, nibbles=nibbles)


def tie_scales(params, anchor):
    """`params` with the scales of IREE's quantized weights (those built without `hoist_barrier`) passed
    through one optimization barrier with `anchor`, a value of the current decode step: their dequantization
    then cannot be hoisted out of the decode loop, where iree-compile otherwise built every weight's float
    copy at once. The weights themselves are not touched (a barrier on them copied them)."""
    def tied(leaf):
        return isinstance(leaf, QuantizedWeight) and not leaf.hoist_barrier

    leaves, tree = jax.tree.flatten(params, is_leaf=tied)
    if not any(tied(leaf) for leaf in leaves):
        return params
    scales, _ = jax.lax.optimization_barrier(([leaf.scale for leaf in leaves if tied(leaf)], anchor))
    scales = iter(scales)
    return jax.tree.unflatten(tree, [dataclasses.replace(leaf, scale=next(scales)) if tied(leaf) else leaf
                                     for leaf in leaves])


def uses_stored_words(scheme: QuantScheme, activations: Activations) -> bool:
    """Whether XLA multiplies this scheme's compressed-tensors bytes as stored (float activations: the sign is
    restored on the rows a step reads), so a CPU device can use the checkpoint's own pages; W8A8 multiplies
    signed int8 values, a copy."""
    return scheme.matmul_activations(activations) == "float"


def xla_row_block(shape: tuple[int, int], dtype) -> int:
    """Rows per float copy on XLA: small blocks in a loop, but int4 values in whole blocks, unrolled (XLA's
    while loop carries them widened to int8: a copy of the matrix)."""
    return row_block_for(shape, None if dtype == jnp.int4 else LOOP_COPY_BYTES)


def _splits_in_nibbles(shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> bool:
    """Whether a 4-bit matrix's rows split into byte pairs that never straddle a scale group."""
    return shape[1] % 2 == 0 and (shape[1] // scale_shape[1]) % 2 == 0


def split_nibbles(packed: jax.Array, offset: int = 0) -> tuple[jax.Array, jax.Array]:
    """The signed int8 values of the low and the high nibbles of `packed` bytes (columns 0, 2, ... and 1, 3, ...),
    each nibble stored plus `offset` (0 or 8)."""
    if offset:
        packed = packed ^ jnp.asarray(offset * 0x11, packed.dtype)
    signed = jax.lax.bitcast_convert_type(packed, jnp.int8)
    four = jnp.int8(4)
    return (jax.lax.shift_right_arithmetic(jax.lax.shift_left(signed, four), four),
            jax.lax.shift_right_arithmetic(signed, four))


def row_block_for(shape: tuple[int, ...], copy_bytes: int | None = None) -> int:
    """Rows per float copy of at most `copy_bytes` (default FLOAT_COPY_BYTES) for a float-activation matmul on a
    matrix of `shape` (0: the whole matrix; LLaDA-8B's 4-bit head unsplit gave a 2.07 GB float copy, and a
    NaN, in an IREE bundle)."""
    rows, columns = shape
    block = max(1, (copy_bytes or FLOAT_COPY_BYTES) // (columns * 4))
    return block if rows > block else 0


def restore_sign(offset: jax.Array, bits: int) -> jax.Array:
    """Signed values from compressed-tensors' offset ones read as int4/int8 (`quantize.pack_int32` stores
    v + 2**(bits-1) mod 2**bits, whose two's-complement reading xor the sign bit is v)."""
    return jax.lax.bitwise_xor(offset, jnp.asarray(-(1 << (bits - 1)), offset.dtype))


def offset_values(packed: jax.Array, bits: int, activations: Activations) -> tuple[jax.Array, int]:
    """(values, offset) of compressed-tensors' offset integers read as int4/int8: for float activations read
    unsigned, the offset undone in float after the bit-extend (IREE bundles: no op on the integers that
    iree-compile would hoist into a copy of every weight); for int8 activations (int8 x int8) signed again."""
    if activations == "int8":
        return restore_sign(packed, bits), 0
    return jax.lax.bitcast_convert_type(packed, UNSIGNED[bits]), 1 << (bits - 1)


UNSIGNED = {4: jnp.uint4, 8: jnp.uint8}


def from_packed_bytes(packed: jax.Array, scale: jax.Array, bits: int, activations: Activations,
                      kernel: str = "") -> QuantizedWeight:
    """A QuantizedWeight on XLA from a matrix's compressed-tensors bytes `[O, I * bits / 8]` uint8 (values offset
    by 2**(bits-1); two 4-bit values per byte, low nibble first; `kernel`: ours takes them, also a stack of
    experts' `[E, O, I * bits / 8]`) and stored scales."""
    shape = (packed.shape[-2], packed.shape[-1] * 8 // bits)
    if kernel:  # a staged stage holds them as int8 already (`staging.packing.quantized_layout`)
        values = packed if packed.dtype == jnp.int8 else jax.lax.bitcast_convert_type(packed, jnp.int8)
        return QuantizedWeight(values, scale, activations,
                               offset=1 << (bits - 1), nibbles=bits == 4, kernel=kernel)
    if bits == 4 and _splits_in_nibbles(shape, scale.shape):
        return QuantizedWeight(packed, scale, activations, xla_row_block(shape, jnp.uint8), offset=8, nibbles=True)
    if bits == 8:
        values = jax.lax.bitcast_convert_type(packed, jnp.int8)
    else:
        values = jax.lax.bitcast_convert_type(packed, jnp.int4).reshape(packed.shape[0], -1)
    return QuantizedWeight(restore_sign(values, bits), scale, activations, xla_row_block(shape, values.dtype))


def unpack_stage(weights: dict, quantization) -> dict:
    """A staged stage's tensors with each quantized matrix `(name, bits, activations, kernel)` of `quantization`
    rebuilt from its `<name>.values` / `<name>.scale` parts (see `llada_jax.staging.packing.ByteLayout`)."""
    if not quantization:
        return weights
    out = {name: w for name, w in weights.items() if not name.endswith((".values", ".scale"))}
    for name, bits, activations, kernel in quantization:
        out[name] = from_packed_bytes(weights[f"{name}.values"], weights[f"{name}.scale"], bits, activations, kernel)
    return out


def as_numbers(values: jax.Array, dtype, offset: int = 0) -> jax.Array:
    """Integer `values` as `dtype` numbers, their storage offset undone (exact: small integers)."""
    if dtype == jnp.bfloat16 and not offset and jnp.issubdtype(values.dtype, jnp.integer) and values.itemsize == 1:
        return _truncated_bf16(values.astype(jnp.float32))
    numbers = values.astype(dtype)
    return numbers - jnp.asarray(offset, dtype) if offset else numbers


def _truncated_bf16(x: jax.Array) -> jax.Array:
    """float32 `x` whose low 16 bits are zero (8-bit integers) as bf16, exactly, without XLA's rounding code."""
    return jax.lax.bitcast_convert_type((jax.lax.bitcast_convert_type(x, jnp.uint32) >> 16).astype(jnp.uint16),
                                        jnp.bfloat16)


def rounded_bf16(x: jax.Array) -> jax.Array:
    """float32 `x` rounded to the nearest bf16, ties to even: `x.astype(bfloat16)` for every finite x and
    infinity, in half XLA's CPU instructions (its conversion also keeps the payload of any NaN)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))
    return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)


def stored_matmul(x: jax.Array, weight: jax.Array, columns: bool = False, offset: int = 0,
                  barrier: bool = True) -> jax.Array:
    """x `[B, W, I]` @ weight `[O, I]`.T in float32, the weight read in the dtype it is stored in. With
    `columns`, x is feature-major `[I, R]` and the product is weight @ x `[O, R]` (`llada_jax.model.layout`).

    A weight that is not float32 passes through an optimization barrier with x, so whatever XLA derives
    from it (an int8 -> float conversion, a bf16 transpose for its CPU matmul) depends on the step's input
    and cannot be hoisted out of a loop: in the compiled decode loop XLA otherwise built a float32 or
    transposed copy of every weight before the loop (LLaDA-8B: the whole model again). IREE bundles pass
    `barrier=False` (`QuantizedWeight.hoist_barrier`): a barrier there keeps the conversion out of the matmul."""
    if weight.dtype != jnp.float32 and barrier:
        weight, x = jax.lax.optimization_barrier((weight, x))
    return weight_product(x, as_numbers(weight, x.dtype, offset), columns)


def quantized_linear(x: jax.Array, w: QuantizedWeight, columns: bool = False, dtype=None) -> jax.Array:
    """x `[B, W, I]` @ dequantized(w).T, float32 accumulation, in `dtype` (default x's). With `columns` (float
    activations only), x is feature-major `[I, R]` and the result dequantized(w) @ x `[O, R]`.

    Float activations: the weights are dequantized `w.row_block` rows at a time. On XLA that is a loop over
    the rows, behind a barrier with x: the float copies depend on the step's input, so XLA cannot hoist them
    out of a loop (the compiled decode loop's while body: LLaDA-8B int4 asked for 30 GB, every weight
    dequantized at once before it). IREE bundles, and int4 values (`xla_row_block`), unroll the blocks."""
    dtype = dtype or x.dtype
    if w.kernel:
        return own_kernels.linear(x, w.values, w.scale, w.kernel, columns).astype(dtype)
    if w.activations == "int8":
        if columns:
            raise ValueError("W8A8 matmuls run position-major (llada_jax.model.layout.LayoutRule.pick)")
        return _int8_linear(x, w).astype(dtype)
    values, scales = w.values, w.scale
    if w.hoist_barrier:  # the scales too: XLA hoisted their widening out of the decode loop, a float32 copy
        values, scales, x = jax.lax.optimization_barrier((values, scales, x))
    halves = _nibble_activations(x, columns) if w.nibbles else (x,)

    def rows(start, count):
        scale = _row_slice(scales, start, count).astype(jnp.float32)
        return _block_product(halves, _row_slice(values, start, count), scale, w, columns)

    total, block = w.shape[0], w.row_block or w.shape[0]
    axis = 0 if columns else x.ndim - 1
    if not w.hoist_barrier or values.dtype == jnp.int4:
        blocks = [rows(start, min(block, total - start)).astype(dtype) for start in range(0, total, block)]
        return jnp.concatenate(blocks, axis)
    shape = (total, x.shape[1]) if columns else (*x.shape[:-1], total)
    return _row_loop(rows, total, block, axis, shape).astype(dtype)


def _row_slice(array: jax.Array, start, count: int) -> jax.Array:
    if isinstance(start, int):
        return array[start:start + count]
    return jax.lax.dynamic_slice_in_dim(array, start, count)


def _row_loop(rows, total: int, block: int, axis: int, shape: tuple) -> jax.Array:
    """The float32 product `shape` built from `rows(start, count)` in a loop over whole blocks, then the rest
    (a float32 buffer: XLA updated a bf16 one by copying it whole each time)."""
    count, rest = divmod(total, block)
    if count == 1 and not rest:
        return rows(0, total)

    def step(index, out):
        return jax.lax.dynamic_update_slice_in_dim(out, rows(index * block, block), index * block, axis)

    out = jax.lax.fori_loop(0, count, step, jnp.zeros(shape, jnp.float32))
    if rest:
        out = jax.lax.dynamic_update_slice_in_dim(out, rows(count * block, rest), count * block, axis)
    return out


def _nibble_activations(x: jax.Array, columns: bool) -> tuple[jax.Array, jax.Array]:
    """x's even and odd features, which the low and high nibbles of `nibbles` weights multiply."""
    if columns:
        return x[0::2], x[1::2]
    return x[..., 0::2], x[..., 1::2]


def _block_product(xs: tuple, values: jax.Array, scale: jax.Array, w: QuantizedWeight, columns: bool) -> jax.Array:
    """The float32 product of activation parts `xs` with rows `values` of `w` dequantized by `scale`."""
    parts, offset = _signed_parts(values, w)
    if scale.shape[1] == 1:
        products = (stored_matmul(x, part, columns, offset, barrier=False) for x, part in zip(xs, parts))
        return functools.reduce(operator.add, products) * (scale if columns else scale[:, 0])
    products = (weight_product(x, _dequantized(part, scale, offset, x.dtype), columns) for x, part in zip(xs, parts))
    return functools.reduce(operator.add, products)


def _signed_parts(values: jax.Array, w: QuantizedWeight) -> tuple[tuple, int]:
    """The arrays of `w`'s values (rows `values`) its matmul multiplies, and the offset still on them."""
    if w.kernel:  # a kernel's bytes, held as int8 (the embedding's rows read here)
        values = jax.lax.bitcast_convert_type(values, jnp.uint8)
    if w.nibbles:
        return split_nibbles(values, w.offset), 0
    if w.offset and w.hoist_barrier:  # XLA: offset int8 bytes, the sign restored on these rows only
        return (jax.lax.bitcast_convert_type(values ^ jnp.uint8(0x80), jnp.int8),), 0
    return (values,), w.offset


def _dequantized(values: jax.Array, scale: jax.Array, offset: int, dtype) -> jax.Array:
    """values `[O, I]` times their group's scale `[O, G]`, computed in float32, in `dtype`."""
    rows, width = values.shape
    groups = scale.shape[1]
    weight = (as_numbers(values, jnp.float32, offset).reshape(rows, groups, width // groups) * scale[..., None])
    weight = weight.reshape(rows, width)
    return rounded_bf16(weight) if dtype == jnp.bfloat16 else weight.astype(dtype)


def _int8_linear(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    x32 = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    x_scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    x_q = jnp.clip(jnp.round(x32 / x_scale), -127, 127).astype(jnp.int8)
    acc = jnp.einsum("bwi,oi->bwo", x_q, w.values, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * x_scale * w.scale[:, 0].astype(jnp.float32)


def quantized_rows(w: QuantizedWeight, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of a per-row quantized table (the embedding), dequantized to `dtype`."""
    if w.scale.shape[1] != 1:
        raise LladaError("a quantized embedding needs one scale per row")
    parts, offset = _signed_parts(w.values[ids], w)
    values = jnp.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)
    return (as_numbers(values, jnp.float32, offset) * w.scale[ids].astype(jnp.float32)).astype(dtype)


def nbytes(leaf) -> int:
    if isinstance(leaf, QuantizedWeight):
        return int(np.prod(leaf.values.shape)) * jnp.iinfo(leaf.values.dtype).bits // 8 + leaf.scale.nbytes
    return int(leaf.nbytes)
