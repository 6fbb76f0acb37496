"""A sparse MoE MLP as an inference engine runs one: route once per position, then each expert computes only
the positions routed to it, never all experts on every position.

Routing as LLaDA-MoE's reference: router logits, softmax over every expert in float32, the top k kept with
their probabilities (no renormalisation), SwiGLU experts, the outputs summed weighted by those probabilities.
LLaDA2's (`sigmoid-grouped`): float32 sigmoid scores, experts chosen on score + expert_bias among the best
groups (a group scores the sum of its top 2), weighted by their unbiased scores normalised to sum 1 times the
scaling factor, summed in float32; plus the shared expert on every position.
The routed (position, expert) pairs are sorted by expert, and each expert computes its run of the sorted rows.
The experts' matrices come in one of two forms:
- a list per matrix kind, one array each (XLA's own code, IREE bundles that bind the checkpoint's own files): each
  expert runs over its run in tiles of a fixed size (shapes stay static, the trip counts follow the routing), so
  the work is the routed rows plus at most one partly filled tile per expert, and every product reads its
  expert's weights where they lie: a stacked `[experts, ...]` array sliced by a traced index was copied out per
  expert, and XLA's CPU `ragged_dot` computes every group on every row (dense-masked); both measured in
  eval/RESULTS.md ("The MoE layer against its floors");
- a stack `[experts, ...]` per matrix kind (XLA where our kernels take every expert, `kernels_take_experts`,
  resident or staged; IREE bundles, whose archive or stage reads put the experts back to back): our routed kernels
  take the whole stack and each expert's first row, one call per matrix kind; without them one loop runs over
  every expert's tiles. A loop per expert made IREE's compile time grow faster than the experts
  (docs/iree-limits.md).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from llada_jax.kernels import xla as own_kernels
from llada_jax.kernels.schemes import Kernels, scheme_for
from llada_jax.model.layout import Positions, linear, swiglu
from llada_jax.model.params import hf_shapes, tensor_places
from llada_jax.quant.qlinear import QuantizedWeight, stored_matmul
from llada_jax.quant.quantize import Activations

EXPERT_KEYS = ("experts_gate", "experts_up", "experts_down")  # each a list of one matrix per expert, or a stack


def sparse_mlp(block: dict, x: jax.Array, config) -> jax.Array:
    """The MoE MLP of position-major `x` `[B, W, D]` (the normed residual), in x's dtype."""
    b, w, d = x.shape
    rows = x.reshape(b * w, d)
    if config.router == "sigmoid-grouped":
        experts, weights = grouped_route(block, rows, config)
    else:
        probs = jax.nn.softmax(linear(rows[None], block["router"]).astype(jnp.float32)[0], axis=-1)
        weights, experts = jax.lax.top_k(probs, config.experts_per_token)
        weights = weights.astype(x.dtype)
    out = routed_sum(block, rows, experts, weights)
    if "shared_gate" in block:
        out = out + swiglu(Positions, rows[None], block["shared_gate"], block["shared_up"], block["shared_down"])[0]
    return out.reshape(b, w, d)


def grouped_route(block: dict, rows: jax.Array, config) -> tuple[jax.Array, jax.Array]:
    """LLaDA2's router: the chosen experts `[R, k]` and their float32 weights."""
    logits = stored_matmul(rows.astype(jnp.float32)[None], block["router"].astype(jnp.float32))[0]
    scores = jax.nn.sigmoid(logits)
    biased = scores + block["expert_bias"].astype(jnp.float32)
    r, n = biased.shape
    groups = biased.reshape(r, config.expert_groups, n // config.expert_groups)
    group_scores = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)
    kept_groups = jax.lax.top_k(group_scores, config.groups_kept)[1]
    kept = jnp.zeros(group_scores.shape, bool).at[jnp.arange(r)[:, None], kept_groups].set(True)
    candidates = jnp.where(jnp.repeat(kept, n // config.expert_groups, axis=1), biased, -jnp.inf)
    experts = jax.lax.top_k(candidates, config.experts_per_token)[1]
    chosen = jnp.take_along_axis(scores, experts, axis=1)
    weights = chosen / (jnp.sum(chosen, axis=-1, keepdims=True) + 1e-20) if experts.shape[1] > 1 else chosen
    return experts, weights * config.routed_scaling


# Experts whose loops accumulate into one buffer, one after the other: IREE 3.13's dispatch-argument solver follows
# such a chain a loop per round, stops after 32 rounds and fails the compile without a message (docs/iree-limits.md).
CHAIN_EXPERTS = 16

GROUPED_ROW_TILES = 4  # group-wise quantized experts averaging at most this many rows run one row per tile


def tile_rows(routed: int, n_experts: int, grouped: bool = False) -> int:
    """Rows per expert tile: about the mean rows per expert, a power of two in [8, 64] (XLA's CPU products on
    fewer rows ran slower per expert, not faster); group-wise quantized experts with few rows each, one row (a
    one-row product reads the packed weights, where a wider tile first dequantizes its groups; per-channel int8
    ran slower so; eval/RESULTS.md, "The MoE layer against its floors")."""
    mean = max(1, routed // n_experts)
    if grouped and mean <= GROUPED_ROW_TILES:
        return 1
    return min(64, max(8, 1 << (mean - 1).bit_length()))


def routed_sum(block: dict, rows: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """Σ_j weights[r, j] * expert_{experts[r, j]}(rows[r]) for every row r: `[R, D]`, summed in the weights'
    dtype, returned in the rows'."""
    r, d = rows.shape
    k = experts.shape[1]
    flat = experts.reshape(-1)  # the pairs grouped by expert, stable, with no sort: IREE 3.13 misplaced some
    # pairs of an argsort inside a compiled decode loop (docs/iree-limits.md)
    chosen = flat[:, None] == jnp.arange(expert_count(block["experts_gate"]), dtype=flat.dtype)  # [pairs, E]
    counts = jnp.sum(chosen, axis=0, dtype=jnp.int32)
    earlier = jnp.sum(jnp.where(chosen, jnp.cumsum(chosen, axis=0, dtype=jnp.int32), 0), axis=1) - 1
    sorted_at = (jnp.cumsum(counts) - counts)[flat] + earlier  # each pair's place, grouped by expert, stable
    order = jnp.zeros(r * k, jnp.int32).at[sorted_at].set(jnp.arange(r * k, dtype=jnp.int32))
    run = listed_experts if isinstance(block["experts_gate"], list) else stacked_experts
    per_pair = run(block, rows[order // k], counts)[sorted_at]
    return jnp.sum(per_pair.reshape(r, k, d).astype(weights.dtype) * weights[..., None], axis=1).astype(rows.dtype)


def kernels_take_experts(config, quantized: dict, kernels: Kernels, activations: Activations) -> bool:
    """Whether our kernels multiply every expert matrix of a sparse MoE model (`kernels` as `kernels_in_use`
    chose): its experts are then held stacked and run as one routed call per matrix kind
    (`weights.checkpoint.load_params`), no loop per expert."""
    if kernels != "own" or not config.n_experts:
        return False
    shapes = hf_shapes(config)
    experts = [name for name, place in tensor_places(config).items() if len(place) == 4]
    schemes = [quantized.get(name.removesuffix(".weight")) for name in experts]
    return all(scheme is not None and scheme_for(scheme.bits, activations, shapes[name][1],
                                                 scheme.group_size or shapes[name][1]) is not None
               for name, scheme in zip(experts, schemes))


def stacked(matrices: list):
    """One expert matrix kind's list as one stack `[E, ...]` (arrays, or `QuantizedWeight`s alike)."""
    return jax.tree.map(lambda *parts: jnp.stack(parts), *matrices)


def expert_count(matrices) -> int:
    """How many experts a matrix kind holds: a list of one matrix each, or one stack `[E, ...]`."""
    if isinstance(matrices, list):
        return len(matrices)
    return (matrices.values if isinstance(matrices, QuantizedWeight) else matrices).shape[0]


def _grouped(matrix) -> bool:
    """Group-wise quantized (scales per group of columns, not per row)."""
    return isinstance(matrix, QuantizedWeight) and matrix.scale.shape[-1] > 1


def listed_experts(block: dict, sorted_rows: jax.Array, counts: jax.Array) -> jax.Array:
    """Each expert's outputs on its run of `sorted_rows` (grouped by expert, `counts` each), the experts a list
    of arrays: a loop over tiles per expert, in chains (`CHAIN_EXPERTS`)."""
    p, d = sorted_rows.shape
    n_experts = len(block["experts_gate"])
    tile = tile_rows(p, n_experts, _grouped(block["experts_gate"][0]))
    padded = jnp.concatenate([sorted_rows, jnp.zeros((tile, d), sorted_rows.dtype)])
    starts = jnp.cumsum(counts) - counts
    chains = []  # each chain's accumulator holds its experts' rows and zeros elsewhere: their sum is exact
    for chain in range(0, n_experts, CHAIN_EXPERTS):
        out = jnp.zeros((p + tile, d), sorted_rows.dtype)
        for e in range(chain, min(chain + CHAIN_EXPERTS, n_experts)):
            matrices = tuple(block[key][e] for key in EXPERT_KEYS)
            out = jax.lax.fori_loop(0, (counts[e] + tile - 1) // tile,
                                    _tile_step(padded, matrices, starts[e], counts[e], tile), out)
        chains.append(out)
    return functools.reduce(operator.add, chains)[:p]


def stacked_experts(block: dict, sorted_rows: jax.Array, counts: jax.Array) -> jax.Array:
    """`listed_experts`' outputs, the experts stacked `[E, ...]` (`kernels_take_experts`, `lowering.stage_ring`):
    with our kernels one routed call per matrix kind (`kernels.xla.routed_matmul`); else one loop over every
    expert's tiles, each slicing its expert out of the stack. No loop per expert: a compiled step's size and
    compile time do not grow with the experts."""
    gate, up, down = (block[key] for key in EXPERT_KEYS)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
    if all(isinstance(m, QuantizedWeight) and m.kernel for m in (gate, up, down)):
        def product(x, w):
            return own_kernels.routed_matmul(x, w.values, w.scale, w.kernel, starts).astype(x.dtype)
        return product(jax.nn.silu(product(sorted_rows, gate)) * product(sorted_rows, up), down)
    p, d = sorted_rows.shape
    tile = tile_rows(p, expert_count(gate), _grouped(gate))
    padded = jnp.concatenate([sorted_rows, jnp.zeros((tile, d), sorted_rows.dtype)])
    tiles = (counts + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles)

    def one_tile(t, out):
        e = jnp.sum(tile_ends <= t)  # the expert whose tiles hold tile t
        local = t - (tile_ends[e] - tiles[e])
        matrices = tuple(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=False), m)
                         for m in (gate, up, down))
        return _tile_step(padded, matrices, starts[e], counts[e], tile)(local, out)

    return jax.lax.fori_loop(0, tile_ends[-1], one_tile, jnp.zeros((p + tile, d), sorted_rows.dtype))[:p]


def _tile_step(padded: jax.Array, matrices: tuple, start: jax.Array, count: jax.Array, tile: int):
    """(t, out) -> `out` plus one expert's outputs on its t-th tile of rows (`count` rows from `start` in
    `padded`); rows of a last partial tile past the run add zeros."""
    gate, up, down = matrices

    def one_tile(t, out):
        first = start + t * tile
        x = jax.lax.dynamic_slice_in_dim(padded, first, tile)[None]
        y = linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)[0]
        y = jnp.where(((t * tile + jnp.arange(tile)) < count)[:, None], y, 0)
        return jax.lax.dynamic_update_slice_in_dim(out, jax.lax.dynamic_slice_in_dim(out, first, tile) + y, first, 0)

    return one_tile
