"""Fixed-shape jitted steps: the full canvas, and a window against cached K/V.

Each returns a readout of the computed positions plus the proposed K/V (never committed here).
The readout is either full float32 logits or, cheaper to read back, the argmax token and its
log-probability per position. Given `rows`, only those rows are read out: the LM head runs on the
positions whose prediction the decoder uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.forward import Context, ForwardOut, forward, head_logits
from llada_jax.model.kv_state import window_key_bias
from llada_jax.model.layout import XLA_LAYOUT, LayoutRule
from llada_jax.model.readout import Readout, ReadoutSpec


def along(vector: jax.Array, axis: int, ndim: int) -> jax.Array:
    """A per-vocabulary `[E]` vector shaped to broadcast along `axis` of an `ndim`-dimensional array."""
    return jnp.expand_dims(vector, tuple(a for a in range(ndim) if a != axis % ndim))


def guided_logits(logits: jax.Array, cfg_scale: jax.Array, logit_bias: jax.Array, readout_spec: ReadoutSpec,
                  vocab_axis: int = -1) -> jax.Array:
    """Apply CFG, then the per-token bias, to float32 logits `[B, W, E]` (or `[E, B, W]`, `vocab_axis` 0).
    Under CFG rows come in (conditional, unconditional) pairs, one per canvas of a batch, and each pair
    gives one row."""
    if readout_spec.cfg:
        batch_axis = 1 if vocab_axis == 0 else 0
        shape = logits.shape
        pairs = logits.reshape(shape[:batch_axis] + (shape[batch_axis] // 2, 2) + shape[batch_axis + 1:])
        cond, uncond = (jnp.take(pairs, i, axis=batch_axis + 1) for i in (0, 1))
        logits = uncond + (cfg_scale + 1.0) * (cond - uncond)
    return logits + along(logit_bias, vocab_axis, logits.ndim)


def first_argmax(logits: jax.Array, axis: int) -> jax.Array:
    """The index of the largest value along `axis` (first on ties), keeping the axis: the max, then the least
    index reaching it. Over the bench-size head's 32768-token vocabulary this ran faster than argmax wherever
    readouts run: XLA on 32 columns 1.4 against 2.9 ms, IREE on 32 rows 1.3 against 5.2 ms (XLA on 192 rows
    is the exception, 20 against 16 ms, behind a 630 ms step)."""
    vocab = logits.shape[axis]
    best = jnp.max(logits, axis=axis, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, axis % logits.ndim)
    first = jnp.min(jnp.where(logits == best, index, vocab), axis=axis, keepdims=True)
    return jnp.minimum(first, vocab - 1)  # NaN logits match nothing; their logp is NaN either way


def argmax_others(logits: jax.Array, confidence_bias: jax.Array, axis: int = -1):
    """x0 = argmax (first on ties) along the vocabulary `axis`, its score `top` (logit + confidence bias) and
    `others`, the sum of exp(score - top) over every other token: p(x0) = 1 / (1 + others)."""
    x0 = first_argmax(logits, axis)
    scored = logits + along(confidence_bias, axis, logits.ndim)
    top = jnp.take_along_axis(scored, x0, axis=axis)
    others = jnp.exp(scored - top)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, axis % logits.ndim)
    others = jnp.where(index == x0, 0.0, others)
    return jnp.squeeze(x0, axis).astype(jnp.int32), jnp.squeeze(top, axis), jnp.sum(others, axis=axis)


def argmax_logprob(logits: jax.Array, confidence_bias: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """x0 = argmax (first on ties) along the vocabulary `axis` and log p(x0) under softmax(logits +
    confidence_bias), accurate near p = 1 where a float32 probability would round to 1."""
    x0, top, others = argmax_others(logits, confidence_bias, axis)
    logp = -jnp.log1p(others)
    # Subnormal log-probabilities are flushed to 0 here, so a device that flushes them itself (XLA's
    # CPU does) ranks them exactly as the host does. x0 left out of the confidence softmax: probability 0.
    logp = jnp.where(logp > -jnp.finfo(jnp.float32).tiny, 0.0, logp)
    return x0, jnp.where(jnp.isneginf(top), -jnp.inf, logp)


def head_rows(hidden: jax.Array, rows) -> jax.Array:
    """The hidden rows `[B, R, D]` at `rows` `[R]` (all rows when None). The caller keeps `rows` within
    the step's rows (a gather clamps silently).

    Gathered by index rather than sliced: IREE reads a dynamic slice's start back to the host, a wait in
    the middle of the call (the bench-size read step on the host CPU: 12.3 ms sliced, 9.5 gathered)."""
    if rows is None:
        return hidden
    return jnp.take(hidden, jnp.asarray(rows, jnp.int32), axis=1, mode="clip")


def read_out(params: dict, hidden: jax.Array, cfg_scale, logit_bias, confidence_bias, readout_spec: ReadoutSpec,
             layout_rule: LayoutRule = XLA_LAYOUT) -> Readout:
    """The readout of `hidden` `[B, W, D]`, reduced over the vocabulary where the head left it (`head_logits`)."""
    logits, vocab_axis = head_logits(params, hidden, layout_rule)
    logits = guided_logits(logits, cfg_scale, logit_bias, readout_spec, vocab_axis)
    if readout_spec.kind == "logits":
        return Readout(logits=jnp.moveaxis(logits, vocab_axis, -1))
    x0, logp = argmax_logprob(logits, confidence_bias, vocab_axis)
    return Readout(x0=x0, logp=logp)


def full_forward(params: dict, tokens: jax.Array, valid: jax.Array, config: LLaDAConfig,
                 layout_rule: LayoutRule = XLA_LAYOUT) -> ForwardOut:
    """The layers over a whole canvas `[B, L]` (`valid`: real positions). A real position's rotary position
    counts the real ones before it: left padding shifts nothing."""
    positions = jnp.maximum(jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)
    bias = window_key_bias(valid, xp=jnp)
    return forward(params, tokens, positions, bias, None, config, layout_rule)


def window_forward(params: dict, context: Context, window_ids: jax.Array, window_pos: jax.Array,
                   window_valid: jax.Array, config: LLaDAConfig, layout_rule: LayoutRule = XLA_LAYOUT,
                   window_blocks=None) -> ForwardOut:
    """The layers over W positions `[B, W]` against the cached `context`; invalid positions hidden as keys
    (and, with `window_blocks`, a later block's from an earlier block's queries)."""
    bias = window_key_bias(window_valid, window_blocks, jnp)
    return forward(params, window_ids, window_pos, bias, context, config, layout_rule)


@functools.partial(jax.jit, static_argnames=("config", "readout_spec", "layout_rule"))
def full_step(params: dict, tokens: jax.Array, valid: jax.Array, cfg_scale: jax.Array, logit_bias: jax.Array,
              confidence_bias: jax.Array, rows=None, *, config: LLaDAConfig, readout_spec: ReadoutSpec,
              layout_rule: LayoutRule = XLA_LAYOUT):
    """Whole canvas `[B, L]`; `valid` marks real (non-padding) positions. Returns (readout, K, V), the
    readout at the rows `rows` `[R]` (None: every row)."""
    out = full_forward(params, tokens, valid, config, layout_rule)
    hidden = head_rows(out.hidden, rows)
    readout = read_out(params, hidden, cfg_scale, logit_bias, confidence_bias, readout_spec, layout_rule)
    return readout, out.keys, out.values


@functools.partial(jax.jit, static_argnames=("config", "readout_spec", "layout_rule"))
def window_step(params: dict, context: Context, window_ids: jax.Array, window_pos: jax.Array,
                window_valid: jax.Array, cfg_scale: jax.Array, logit_bias: jax.Array, confidence_bias: jax.Array,
                rows=None, window_blocks=None, *, config: LLaDAConfig, readout_spec: ReadoutSpec,
                layout_rule: LayoutRule = XLA_LAYOUT):
    """W positions `[B, W]` attending to the visible cached slots and to the valid window positions (with
    `window_blocks` `[B, W]`, only those of their own block or an earlier one)."""
    out = window_forward(params, context, window_ids, window_pos, window_valid, config, layout_rule, window_blocks)
    hidden = head_rows(out.hidden, rows)
    readout = read_out(params, hidden, cfg_scale, logit_bias, confidence_bias, readout_spec, layout_rule)
    return readout, out.keys, out.values


@jax.jit
def scatter_slots(cache: jax.Array, positions: jax.Array, proposed: jax.Array) -> jax.Array:
    """cache `[N, B, S, K, hd]` with `proposed` `[N, B, W, K, hd]` written at slot `positions` `[B, W]`.

    Written as gather + select, not scatter: positions equal to S ("do not write") never index memory
    (IREE's scatter does not bounds-check), and every slot is either copied or replaced exactly.
    """
    targeted = positions[:, :, None] == jnp.arange(cache.shape[2])   # [B, W, S]
    written = targeted.any(axis=1)                                      # [B, S]
    source = jnp.argmax(targeted, axis=1)                               # [B, S]: first window entry per slot
    gathered = jnp.take_along_axis(proposed, source[None, :, :, None, None], axis=2)
    return jnp.where(written[None, :, :, None, None], gathered.astype(cache.dtype), cache)
