"""A sparse MoE MLP as an inference engine runs one: route once per position, then each expert computes only
the positions routed to it, never all experts on every position.

Routing as LLaDA-MoE's reference: router logits, softmax over every expert in float32, the top k kept with
their probabilities (no renormalisation), SwiGLU experts, the outputs summed weighted by those probabilities.
The routed (position, expert) pairs are sorted by expert; each expert runs over its run of the sorted rows in
tiles of a fixed size (shapes stay static, the trip counts follow the routing), so the work is the routed
rows plus at most one partly filled tile per expert. The experts are separate arrays, one loop each, so every
product reads its expert's weights where they lie: a stacked `[experts, ...]` array sliced by a traced index
was copied out per expert, and XLA's CPU `ragged_dot` computes every group on every row (dense-masked); both
measured in eval/RESULTS.md ("The MoE layer against its floors").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llada_jax.model.layout import linear

EXPERT_KEYS = ("experts_gate", "experts_up", "experts_down")  # each a list of one matrix per expert


def sparse_mlp(block: dict, x: jax.Array, experts_per_token: int) -> jax.Array:
    """The MoE MLP of position-major `x` `[B, W, D]` (the normed residual), in x's dtype."""
    b, w, d = x.shape
    rows = x.reshape(b * w, d)
    probs = jax.nn.softmax(linear(rows[None], block["router"]).astype(jnp.float32)[0], axis=-1)
    weights, experts = jax.lax.top_k(probs, experts_per_token)
    return routed_sum(block, rows, experts, weights.astype(x.dtype)).reshape(b, w, d)


def tile_rows(routed: int, n_experts: int) -> int:
    """Rows per expert tile: about the mean rows per expert, a power of two in [8, 64] (XLA's CPU products on
    fewer rows ran slower per expert, not faster)."""
    mean = max(1, routed // n_experts)
    return min(64, max(8, 1 << (mean - 1).bit_length()))


def routed_sum(block: dict, rows: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """Σ_j weights[r, j] * expert_{experts[r, j]}(rows[r]) for every row r: `[R, D]`."""
    r, d = rows.shape
    k = experts.shape[1]
    n_experts = len(block["experts_gate"])
    tile = tile_rows(r * k, n_experts)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # routed pairs grouped by expert
    sorted_rows = jnp.concatenate([rows[order // k], jnp.zeros((tile, d), rows.dtype)])
    counts = jnp.bincount(flat, length=n_experts)
    starts = jnp.cumsum(counts) - counts
    out = jnp.zeros((r * k + tile, d), rows.dtype)
    for e in range(n_experts):
        gate, up, down = (block[key][e] for key in EXPERT_KEYS)

        def one_tile(t, out, e=e, gate=gate, up=up, down=down):
            first = starts[e] + t * tile
            x = jax.lax.dynamic_slice_in_dim(sorted_rows, first, tile)[None]
            y = linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)[0]
            y = jnp.where(((t * tile + jnp.arange(tile)) < counts[e])[:, None], y, 0)
            return jax.lax.dynamic_update_slice_in_dim(out, jax.lax.dynamic_slice_in_dim(out, first, tile) + y,
                                                       first, 0)

        out = jax.lax.fori_loop(0, (counts[e] + tile - 1) // tile, one_tile, out)
    per_pair = jnp.zeros((r * k, d), rows.dtype).at[order].set(out[: r * k])
    return jnp.sum(per_pair.reshape(r, k, d) * weights[..., None], axis=1)
