"""The forward pass cut into fixed-shape pieces for staged execution: the embedding (a host gather),
one decoder layer taking its weights as arguments, and the final norm + one vocabulary chunk of the
LM head. The same compiled layer serves every layer, the same head piece every chunk. Weights come
as a dict of tensors: views of one packed stage in a staging slot (see `packing`), never sliced
in-graph."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.forward import decoder_layer, final_hidden, lm_logits, rotary_tables
from llada_jax.model.layout import XLA_LAYOUT, LayoutRule
from llada_jax.model.params import block_from_stage
from llada_jax.model.readout import HeadChunkReadout, Readout, ReadoutSpec
from llada_jax.model.steps import argmax_others, guided_logits
from llada_jax.quant.qlinear import unpack_stage


@functools.partial(jax.jit, static_argnames=("config", "quantization", "layout_rule"))
def layer_step(weights, x: jax.Array, positions: jax.Array, key_bias: jax.Array,
               cached_keys, cached_values, *, config: LLaDAConfig, quantization=(),
               layout_rule: LayoutRule = XLA_LAYOUT):
    """One decoder layer over `x` `[B, W, D]`; cached K/V `[B, S, K, hd]` (or None for a full step)
    come first in the keys, biased by `key_bias` `[B, S + W]` (or `[B, W]`). Returns x, k, v.
    `quantization`: the stage's quantized matrices, stored as packed bytes (`qlinear.unpack_stage`)."""
    weights = block_from_stage(unpack_stage(weights, quantization))
    rotary = rotary_tables(positions, config.rotary_width, config.rope_theta)
    cached = None if cached_keys is None else (cached_keys, cached_values)
    return decoder_layer(weights, x, rotary, cached, key_bias, config, layout_rule=layout_rule)


@functools.partial(jax.jit, static_argnames=("config", "readout_spec", "quantization", "layout_rule"))
def head_chunk_step(weights, x: jax.Array, cfg_scale, logit_bias, confidence_bias, *,
                    config: LLaDAConfig, readout_spec: ReadoutSpec, quantization=(),
                    layout_rule: LayoutRule = XLA_LAYOUT):
    """Final norm and one vocabulary chunk of the LM head; `logit_bias`/`confidence_bias` are that
    chunk's slices (padding rows: -inf logit bias). Returns the chunk's guided logits, or its
    partial readout (`partial_readout`), which `readout.combine_head_chunks` merges across chunks."""
    weights = unpack_stage(weights, quantization)
    hidden = final_hidden(x, weights["ln_f"], config)
    logits = lm_logits({"lm_head": weights["lm_head"]}, hidden, layout_rule)
    logits = guided_logits(logits, cfg_scale, logit_bias, readout_spec)
    return Readout(logits=logits) if readout_spec.kind == "logits" else partial_readout(logits, confidence_bias)


def partial_readout(logits: jax.Array, confidence_bias: jax.Array) -> HeadChunkReadout:
    """Over one vocabulary chunk `[B, W, rows]`: x0 (chunk argmax, first on ties), lmax (its logit),
    top (its score, logit + confidence bias), others (sum of exp(score - top) over the chunk's other
    tokens), smax and ssum (the chunk's max score and sum of exp(score - smax))."""
    x0, top, others = argmax_others(logits, confidence_bias)
    scored = logits + confidence_bias
    smax = jnp.max(scored, axis=-1)
    safe = jnp.where(jnp.isneginf(smax), 0.0, smax)  # a chunk with every score -inf sums to 0
    return HeadChunkReadout(x0, jnp.max(logits, axis=-1), top, others, smax,
                            jnp.sum(jnp.exp(scored - safe[..., None]), axis=-1))
