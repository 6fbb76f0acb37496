"""The forward pass as pure functions over the params pytree, shared by every family (`llada_jax.families`).

Bidirectional llama-style blocks: RMSNorm (float32), rotary embeddings (float32, rotate-half),
grouped K/V attention without a causal mask, SwiGLU MLP (`ff_proj` is the SiLU-gated branch, `up_proj`
the linear one, the block's `ff_out` the down projection), a separate LM head. The family deltas, each a
config flag: q/k/v biases (Dream), per-head q/k RMSNorm before RoPE and a sparse MoE MLP (LLaDA-MoE,
`llada_jax.model.moe`), logits shifted one position (Dream: `shift_rows`); LLaDA2's fused q/k/v, partial rotary
and per-layer dense or sparse MLPs (its block-causal attention is the decoder's: `policies.block_diffusion`).

Shapes: B batch, W query positions, T = S cached slots + W keys, H heads, K kv-heads, G = H / K,
D model width, E embedding (vocab) size, N layers.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.kv_state import with_context_bias
from llada_jax.model.layout import XLA_LAYOUT, Features, LayoutRule, rms_norm, swiglu
from llada_jax.model.moe import sparse_mlp
from llada_jax.model.staged import fetch, fetch_each
from llada_jax.quant.products import float_product
from llada_jax.quant.qlinear import QuantizedWeight, quantized_linear, quantized_rows, stored_matmul


class Context(NamedTuple):
    """Cached K/V the queries may attend to, with a 0 / HIDDEN bias per cached slot."""

    keys: jax.Array    # [N, B, S, K, hd], rotary already applied
    values: jax.Array  # [N, B, S, K, hd]
    bias: jax.Array    # [B, S] float32


class ForwardOut(NamedTuple):
    hidden: jax.Array  # [B, W, D] after the final norm
    keys: jax.Array    # [N, B, W, K, hd] proposed K/V of the computed positions (rotary applied)
    values: jax.Array  # [N, B, W, K, hd]


def rotary_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[B, W, hd]` in float32 for absolute positions `[B, W]`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on `[B, W, heads, hd]`, computed in float32; with tables narrower than hd (partial
    rotary), on the first dims only, the rest passed through."""
    width = cos.shape[-1]
    x32 = x.astype(jnp.float32)
    turned, kept = x32[..., :width], x32[..., width:]
    first, second = jnp.split(turned, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    turned = turned * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return (jnp.concatenate([turned, kept], axis=-1) if kept.shape[-1] else turned).astype(x.dtype)


def attention(q: jax.Array, keys: jax.Array, values: jax.Array, key_bias: jax.Array) -> jax.Array:
    """Bidirectional attention of q `[B, W, H, hd]` over keys/values `[B, T, K, hd]`; bias `[B, T]`, or per
    query `[B, W, T]` (a window of several diffusion blocks: `kv_state.window_key_bias`).

    Computed head-major: each kv-head's G query heads stacked as G*W rows against its keys `[T, hd]`, so
    both products are plain batched matmuls over (B, K) (XLA's CPU backend ran the position-major einsums
    1.5-1.7x slower)."""
    b, w, h, hd = q.shape
    kv_heads = keys.shape[2]
    group = h // kv_heads
    rows = q.reshape(b, w, kv_heads, group, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, group * w, hd)
    keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
    scores = float_product("bkqd,bktd->bkqt", rows, keys)
    bias = key_bias[:, None, None, :] if key_bias.ndim == 2 else jnp.tile(key_bias, (1, group, 1))[:, None]
    scores = scores / jnp.sqrt(jnp.float32(hd)) + bias
    # The softmax spelled out, scaled by the sum's reciprocal: IREE turns `jax.nn.softmax` into its softmax op,
    # which ran the bench-size full step's 12 softmaxes in 10.1 ms against 5.6 for these two reductions
    # (the step 219 -> 216 ms, every one of 5 alternating runs faster); XLA's steps did not move.
    exps = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = (exps * (1.0 / jnp.sum(exps, axis=-1, keepdims=True))).astype(values.dtype)
    out = float_product("bkqt,bktd->bkqd", probs, values).astype(values.dtype)
    return out.reshape(b, kv_heads, group, w, hd).transpose(0, 3, 1, 2, 4).reshape(b, w, h, hd)


def decoder_layer(block: dict, x: jax.Array, rotary, cached, key_bias: jax.Array, config: LLaDAConfig,
                  layout=None, layout_rule: LayoutRule = XLA_LAYOUT):
    """One block. `cached` is this layer's (keys, values) `[B, S, K, hd]` or None. Returns x, k, v.
    `layout` (`llada_jax.model.layout`) defaults to the one `layout_rule` picks for this many positions (XLA's by
    default; IREE exports pass their target's)."""
    b, w, _ = x.shape
    layout = layout or layout_rule.pick(b * w, block)
    h = layout.enter(x)
    normed = layout.norm(h, block["attn_norm"], config.rms_norm_eps)
    q, k, v = projections(layout, normed, block, config, b, w)
    if config.qk_norm:
        q, k = rms_norm(q, block["q_norm"], config.rms_norm_eps), rms_norm(k, block["k_norm"], config.rms_norm_eps)
    q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    all_k, all_v = k, v
    if cached is not None:
        all_k = jnp.concatenate([cached[0], k], axis=1)
        all_v = jnp.concatenate([cached[1], v], axis=1)
    attended = layout.merge(attention(q, all_k, all_v, key_bias))
    h = h + layout.linear(attended, block["attn_out"])
    normed = layout.norm(h, block["ff_norm"], config.rms_norm_eps)
    if "router" in block:
        return layout.leave(h + sparse_mlp(block, normed, config), b, w), k, v
    return layout.leave(h + swiglu(layout, normed, block["ff_proj"], block["up_proj"], block["ff_out"]), b, w), k, v


def projections(layout, normed, block: dict, config: LLaDAConfig, b: int, w: int):
    """q, k, v `[B, W, heads, hd]`: three projections, or one fused `[q; k; v]` split by heads (LLaDA2)."""
    hd = config.head_dim
    if "qkv_proj" not in block:
        return (layout.heads(projection(layout, normed, block, name), b, w, hd) for name in ("q", "k", "v"))
    fused = layout.heads(layout.linear(normed, block["qkv_proj"]), b, w, hd)
    return jnp.split(fused, [config.n_heads, config.n_heads + config.n_kv_heads], axis=2)


def projection(layout, normed, block: dict, name: str):
    """The `q`, `k` or `v` projection, plus its bias where the family has one."""
    out = layout.linear(normed, block[f"{name}_proj"])
    bias = block.get(f"{name}_bias")
    return out if bias is None else layout.add_bias(out, bias)


def forward(params: dict, tokens: jax.Array, positions: jax.Array, token_bias: jax.Array,
            context: Context | None, config: LLaDAConfig, layout_rule: LayoutRule = XLA_LAYOUT) -> ForwardOut:
    """Run W positions `tokens`/`positions` `[B, W]`, attending to `context` (if any) and to themselves.

    `token_bias` `[B, W]` hides padded positions as keys (`[B, W, W]`: per query). The result's K/V are
    proposals: the caller decides whether to commit them into a KV state.
    """
    x = embed(params["wte"], tokens, params["ln_f"].dtype)
    rotary = rotary_tables(positions, config.rotary_width, config.rope_theta)
    key_bias = token_bias if context is None else with_context_bias(context.bias, token_bias, jnp)
    new_keys, new_values = [], []
    for layer, block in enumerate(params["blocks"]):
        block, x = fetch(block, x)  # a streamed layer is read in here (`llada_jax.model.staged`)
        cached = None if context is None else (context.keys[layer], context.values[layer])
        x, k, v = decoder_layer(block, x, rotary, cached, key_bias, config, layout_rule=layout_rule)
        new_keys.append(k)
        new_values.append(v)
    return ForwardOut(final_hidden(x, params["ln_f"], config), jnp.stack(new_keys), jnp.stack(new_values))


def final_hidden(x: jax.Array, ln_f: jax.Array, config: LLaDAConfig) -> jax.Array:
    """The final norm, and where the family shifts its logits, the shift (`shift_rows`)."""
    hidden = rms_norm(x, ln_f, config.rms_norm_eps)
    return shift_rows(hidden) if config.logits_shift else hidden


def shift_rows(hidden: jax.Array) -> jax.Array:
    """Row i takes row i-1's hidden state, the first row keeps its own: Dream predicts position i from the
    position before it, and its decoders shift within the positions a step computes (a window's first row
    predicts itself)."""
    return jnp.concatenate([hidden[:, :1], hidden[:, :-1]], axis=1)


def embed(table, tokens: jax.Array, dtype) -> jax.Array:
    """Embedding rows `[B, W, D]` in the compute `dtype` (the norm gains' dtype). A table streamed in chunks of
    rows (`llada_jax.model.staged`): each chunk gives the rows of the tokens it holds, zeros elsewhere."""
    if isinstance(table, tuple):
        firsts = [0, *itertools.accumulate(chunk.stored[0].shape[0] for chunk in table)]
        parts = fetch_each(table, tokens, lambda chunk, ids, c: _rows_held(chunk, ids - firsts[c], dtype))
        return functools.reduce(jnp.add, parts)
    if isinstance(table, QuantizedWeight):
        return quantized_rows(table, tokens, dtype)
    # XLA rewrites convert(gather(table)) as gather(convert(table)); fused, that converts only the rows
    # gathered, but in the compiled loop it hoisted the table's conversion out of the while body (a
    # float32 copy of a bf16 table: 2 GB at 8B). Through the barrier the table depends on the step's input.
    table, tokens = jax.lax.optimization_barrier((table, tokens))
    return table[tokens]


def _rows_held(chunk, ids: jax.Array, dtype) -> jax.Array:
    """`embed` of the rows `ids` that `chunk` holds (0 <= id < its rows), zeros for the others."""
    held = (ids >= 0) & (ids < chunk.shape[0])
    return jnp.where(held[..., None], embed(chunk, jnp.where(held, ids, 0), dtype), jnp.zeros((), dtype))


def head_logits(params: dict, hidden: jax.Array, layout_rule: LayoutRule = XLA_LAYOUT) -> tuple[jax.Array, int]:
    """Vocabulary logits in float32 and the axis holding the vocabulary: `[B, W, E]` (axis 2), or `[E, B, W]`
    (axis 0) where a feature-major head leaves them for the readout (`Features.logits`). Float heads run in the
    layout `layout_rule` picks for this many rows (`llada_jax.model.layout`; on XLA the bench-size head on 32 rows
    took 13.0 ms against 16.9 position-major), except bf16 heads on XLA, which run position-major. A head
    streamed in chunks of rows (`llada_jax.model.staged`) gives each chunk's logits, joined position-major."""
    if isinstance(params["lm_head"], tuple):
        logits = fetch_each(params["lm_head"], hidden, lambda head, x, _: _moved(*_logits(head, x, layout_rule)))
        return jnp.concatenate(logits, axis=2), 2
    head, hidden = fetch(params["lm_head"], hidden)
    return _logits(head, hidden, layout_rule)


def _moved(logits: jax.Array, vocab_axis: int) -> jax.Array:
    return jnp.moveaxis(logits, vocab_axis, 2)


def _logits(head, hidden: jax.Array, layout_rule: LayoutRule) -> tuple[jax.Array, int]:
    if isinstance(head, QuantizedWeight):
        return quantized_linear(hidden, head, dtype=jnp.float32), 2
    b, w, _ = hidden.shape
    layout = layout_rule.pick(b * w, {"lm_head": head})
    # XLA runs a feature-major head that is not float32 as a float32 matmul on a float32 copy of the whole head.
    if not issubclass(layout, Features) or (layout_rule.fenced and head.dtype != jnp.float32):
        return stored_matmul(hidden, head), 2
    return layout.logits(layout.matmul(layout.enter(hidden), head), b, w)


def lm_logits(params: dict, hidden: jax.Array, layout_rule: LayoutRule = XLA_LAYOUT) -> jax.Array:
    """Vocabulary logits `[B, W, E]` in float32 (`head_logits`, the vocabulary moved last)."""
    logits, vocab_axis = head_logits(params, hidden, layout_rule)
    return jnp.moveaxis(logits, vocab_axis, -1)
