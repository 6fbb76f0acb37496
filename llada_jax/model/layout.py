"""How one decoder layer lays out its activations: position-major `[B, W, D]` or feature-major `[D, B*W]`.

XLA's CPU matmul is much faster on few rows when the weight is the left operand, `W [O, I] @ h [I, R]`,
than in the position-major `x @ W.T` (the bench-size model's 12 layers of projections on 32 rows: 61-70 ms
against 105-111 ms). So steps of at most FEATURE_ROWS positions run each layer feature-major: the
projections, norms, SwiGLU and residual adds on columns, attention and rotary position-major (a transpose
of a few hundred KB each way); the LM head on as few rows runs feature-major too (`model.head_logits`).
From ~192 rows on, position-major is as fast or faster.
Which steps run feature-major depends on the compiler (`LayoutRule`): XLA up to FEATURE_ROWS positions,
behind a barrier; IREE's CPU targets at every width, without one (the bench-size projections on IREE's host
CPU: 32 rows 70 -> 50 ms, 192 rows 329 -> 233 ms); Vulkan targets never (Mesa's lavapipe driver miscomputed
a reduction over the leading axis fused with the broadcast consuming it). Weight-only quantized
matrices run feature-major as float ones do (`qlinear.quantized_linear(columns=True)`; the bench-size
chain on 32 rows, int8 per channel: 47.3 -> 36.7 ms, int4 in groups of 128: 80.9 -> 62.8 ms); W8A8 stays
position-major.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from llada_jax.quant.qlinear import QuantizedWeight, quantized_linear, stored_matmul

FEATURE_ROWS = 128  # on XLA, steps computing at most this many positions (all rows) run feature-major


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalise in float32 over the last axis, cast back, then scale (the order LLaDA's RMSLayerNorm uses)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x @ weight.T with the torch `[out, in]` layout, accumulated in float32 and returned in x's dtype.

    bf16 weights are consumed as stored: asking for a float32 result keeps XLA on its mixed-precision
    matmul instead of converting every weight to float32 inside the step."""
    if isinstance(weight, QuantizedWeight):
        return quantized_linear(x, weight)
    return stored_matmul(x, weight).astype(x.dtype)


def swiglu(layout, normed, gate, up, down):
    """down(silu(gate(x)) * up(x)), in `layout` (a dense MLP, an MoE's shared expert)."""
    return layout.linear(jax.nn.silu(layout.linear(normed, gate)) * layout.linear(normed, up), down)


class Positions:
    """Activations `[B, W, D]`: one row per position."""

    FEATURE_AXIS = -1

    @staticmethod
    def enter(x):
        return x

    @staticmethod
    def leave(h, b, w):
        return h

    @staticmethod
    def norm(h, weight, eps):
        return rms_norm(h, weight, eps)

    @staticmethod
    def linear(h, weight):
        return linear(h, weight)

    @staticmethod
    def add_bias(h, bias):
        return h + bias.astype(h.dtype)

    @staticmethod
    def heads(h, b, w, head_dim):
        return h.reshape(b, w, -1, head_dim)

    @staticmethod
    def merge(heads):
        b, w, n, hd = heads.shape
        return heads.reshape(b, w, n * hd)


class Features:
    """Activations `[D, B*W]`: one column per position (XLA: fenced, see `fence`)."""

    FEATURE_AXIS = 0

    @staticmethod
    def enter(x):
        b, w, d = x.shape
        return x.reshape(b * w, d).T

    @staticmethod
    def fence(h):
        # Behind the barrier XLA cannot fold what follows (a transpose, a reduction over the features) into
        # the matmul that made `h`: its layout assignment would turn that matmul back into the slow `x @ W.T`.
        return jax.lax.optimization_barrier(h)

    @classmethod
    def leave(cls, h, b, w):
        return cls.fence(h).T.reshape(b, w, -1)

    @classmethod
    def logits(cls, h, b, w):
        """The head's logits columns `[E, B*W]` as the readout takes them, and their vocabulary axis: `[E, B, W]`,
        axis 0 (on XLA, reading out 32 bench-size columns took 1.4 ms, transposing them first 6.2)."""
        return cls.fence(h).reshape(-1, b, w), 0

    @staticmethod
    def norm(h, weight, eps):
        x32 = h.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=0, keepdims=True) + eps)
        return weight[:, None] * x32.astype(h.dtype)

    @staticmethod
    def matmul(h, weight):
        """weight `[O, I]` @ h `[I, R]` in float32, the weight read in the dtype it is stored in."""
        return stored_matmul(h, weight, columns=True)

    @classmethod
    def linear(cls, h, weight):
        if isinstance(weight, QuantizedWeight):
            return quantized_linear(h, weight, columns=True)
        return cls.matmul(h, weight).astype(h.dtype)

    @staticmethod
    def add_bias(h, bias):
        return h + bias.astype(h.dtype)[:, None]

    @staticmethod
    def heads(h, b, w, head_dim):
        return h.reshape(-1, head_dim, b, w).transpose(2, 3, 0, 1)

    @staticmethod
    def merge(heads):
        b, w, n, hd = heads.shape
        return heads.transpose(2, 3, 0, 1).reshape(n * hd, b * w)


# IREE's CPU matmul `W [O, I] @ h [I, R]` slowed down when the sum is long and the columns many: the down
# projection of the bench-size model (I = 2816), 1024 x 2816 on 192 columns, ran at 257 GFLOP/s, on 256 at 139,
# while I = 1024 products ran at ~320 (AVX-512 tiles; without them 228 on 192). Summed in pieces of 704 it ran
# at 313-339 on 192 and 343 on 256; on 96 columns or fewer the split gained nothing. Under the AVX2 tiles of
# `lowering.matmul_tiles` the bench-size layers' products on 192 columns ran in 0.94-0.96x XLA's time whole and
# 0.91-1.04x in pieces (two runs each): no difference beyond the machine's drift.
SPLIT_COLUMNS = 128  # products on at least this many columns...
SPLIT_SUM = 1024     # ...summing over more than this many features...
SUM_PIECE = 768      # ...add up pieces of at most this many


def split_sum(features: int, columns: int) -> list[tuple[int, int]]:
    """The `[start, stop)` pieces of a product's sum over `features` (one piece: not split)."""
    if columns < SPLIT_COLUMNS or features <= SPLIT_SUM:
        return [(0, features)]
    parts = -(-features // SUM_PIECE)
    bounds = [round(i * features / parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class OpenFeatures(Features):
    """Feature-major for IREE: without the barrier (it keeps the layouts it is given, and its decode loops
    failed to compile holding the barrier: "failed to solve for timepoint coverage"), long sums on many
    columns added up in pieces (`split_sum`)."""

    @staticmethod
    def fence(h):
        return h

    @classmethod
    def logits(cls, h, b, w):
        """`[B, W, E]`, axis 2: IREE read out 32 bench-size columns in 3.4 ms, transposed to rows in 1.3."""
        return cls.leave(h, b, w), 2

    @staticmethod
    def matmul(h, weight):
        """weight @ h as `Features.matmul`, with a long sum over I split in pieces (`split_sum`)."""
        products = (Features.matmul(h[start:stop], weight[:, start:stop])
                    for start, stop in split_sum(weight.shape[1], h.shape[1]))
        return functools.reduce(operator.add, products)


class LayoutRule(NamedTuple):
    """Which layout a step of `rows` positions (all rows of the batch) runs in, for one compiler."""

    feature_rows: int         # steps of at most this many positions run feature-major
    fenced: bool              # XLA: the barrier in `Features.fence`; IREE: none, long sums in pieces (`OpenFeatures`)

    def pick(self, rows: int, block: dict) -> type[Positions] | type[Features]:
        """Feature-major up to `feature_rows`; position-major above, for W8A8 weights (their activations
        are quantized per position, over the feature axis of a row) and for sparse MoE layers (routed per
        position)."""
        int8 = any(isinstance(weight, QuantizedWeight) and weight.activations == "int8" for weight in block.values())
        if rows > self.feature_rows or int8 or "router" in block:
            return Positions
        return Features if self.fenced else OpenFeatures


XLA_LAYOUT = LayoutRule(FEATURE_ROWS, fenced=True)
IREE_CPU_LAYOUT = LayoutRule(1 << 30, fenced=False)  # every width (see the module docstring)
POSITION_MAJOR = LayoutRule(0, fenced=False)         # Vulkan targets
