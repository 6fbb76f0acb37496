"""Fixed-shape jitted steps: the full canvas, and a window against cached K/V.

Each returns a readout of the computed positions plus the proposed K/V (never committed here).
The readout is either full float32 logits or, cheaper to read back, the argmax token and its
log-probability per position.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from llada_jax.config import LLaDAConfig
from llada_jax.model import HIDDEN, Context, forward, lm_logits


@dataclasses.dataclass(frozen=True)
class Readout:
    """What a step returns per position (a static jit argument).

    kind: "argmax" (token + log-probability) or "logits".
    cfg: batch rows are (conditional, unconditional); combine them into one row of guided logits.
    forbid_ids: tokens whose logits are -inf before anything else (never predicted).
    unconfident_ids: tokens removed from the confidence softmax; predicting one gives confidence 0.
    """

    kind: str = "argmax"
    cfg: bool = False
    forbid_ids: tuple[int, ...] = ()
    unconfident_ids: tuple[int, ...] = ()


def guided_logits(logits: jax.Array, cfg_scale: jax.Array, readout: Readout) -> jax.Array:
    """Apply CFG and forbidden tokens to float32 logits `[B, W, E]`."""
    if readout.cfg:
        cond, uncond = logits[0:1], logits[1:2]
        logits = uncond + (cfg_scale + 1.0) * (cond - uncond)
    if readout.forbid_ids:
        logits = logits.at[..., list(readout.forbid_ids)].set(-jnp.inf)
    return logits


def argmax_logprob(logits: jax.Array, unconfident_ids: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """x0 = argmax (first on ties) and log p(x0), accurate near p = 1 where float32 p would round."""
    x0 = jnp.argmax(logits, axis=-1)
    scored = logits.at[..., list(unconfident_ids)].set(-jnp.inf) if unconfident_ids else logits
    top = jnp.take_along_axis(scored, x0[..., None], axis=-1)
    others = jnp.exp(scored - top)
    others = jnp.where(jnp.arange(scored.shape[-1]) == x0[..., None], 0.0, others)
    logp = -jnp.log1p(jnp.sum(others, axis=-1))
    # x0 excluded from the confidence softmax: probability 0.
    logp = jnp.where(jnp.isneginf(top[..., 0]), -jnp.inf, logp)
    return x0.astype(jnp.int32), logp


def read_out(params: dict, hidden: jax.Array, cfg_scale: jax.Array, readout: Readout) -> dict:
    logits = guided_logits(lm_logits(params, hidden), cfg_scale, readout)
    if readout.kind == "logits":
        return {"logits": logits}
    x0, logp = argmax_logprob(logits, readout.unconfident_ids)
    return {"x0": x0, "logp": logp}


@functools.partial(jax.jit, static_argnames=("config", "readout"))
def full_step(params: dict, tokens: jax.Array, valid: jax.Array, cfg_scale: jax.Array, *,
              config: LLaDAConfig, readout: Readout):
    """Whole canvas `[B, L]`; `valid` marks real (non-padding) positions. Returns (readout, K, V)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    bias = jnp.where(valid, 0.0, HIDDEN).astype(jnp.float32)
    out = forward(params, tokens, positions, bias, None, config)
    return read_out(params, out.hidden, cfg_scale, readout), out.keys, out.values


@functools.partial(jax.jit, static_argnames=("config", "readout"))
def window_step(params: dict, context: Context, window_ids: jax.Array, window_pos: jax.Array,
                window_valid: jax.Array, cfg_scale: jax.Array, *, config: LLaDAConfig, readout: Readout):
    """W positions `[B, W]` attending to the visible cached slots and to the valid window positions."""
    bias = jnp.where(window_valid, 0.0, HIDDEN).astype(jnp.float32)
    out = forward(params, window_ids, window_pos, bias, context, config)
    return read_out(params, out.hidden, cfg_scale, readout), out.keys, out.values
