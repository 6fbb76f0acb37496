"""The forward pass cut into fixed-shape pieces for staged execution: the embedding (a host gather),
one decoder layer taking its weights as arguments, and the final norm + head. The same compiled
layer serves every layer. Weights come as a dict of tensors: views of one packed stage in a staging
slot (see `packing`), never sliced in-graph."""

from __future__ import annotations

import functools

import jax
import numpy as np

from llada_jax.config import LLaDAConfig
from llada_jax.kv_state import HIDDEN
from llada_jax.model import decoder_layer, rms_norm, rotary_tables
from llada_jax.readout import Readout
from llada_jax.steps import read_out


@functools.partial(jax.jit, static_argnames=("config",))
def layer_step(weights, x: jax.Array, positions: jax.Array, key_bias: jax.Array,
               cached_keys, cached_values, *, config: LLaDAConfig):
    """One decoder layer over `x` `[B, W, D]`; cached K/V `[B, S, K, hd]` (or None for a full step)
    come first in the keys, biased by `key_bias` `[B, S + W]` (or `[B, W]`). Returns x, k, v."""
    rotary = rotary_tables(positions, config.head_dim, config.rope_theta)
    cached = None if cached_keys is None else (cached_keys, cached_values)
    return decoder_layer(weights, x, rotary, cached, key_bias, config)


@functools.partial(jax.jit, static_argnames=("config", "readout"))
def head_step(weights, x: jax.Array, cfg_scale, logit_bias, confidence_bias, *,
              config: LLaDAConfig, readout: Readout):
    """Final norm and LM head, then the readout (as the resident steps do)."""
    hidden = rms_norm(x, weights["ln_f"], config.rms_norm_eps)
    return read_out({"lm_head": weights["lm_head"]}, hidden, cfg_scale, logit_bias, confidence_bias, readout)


def key_bias(valid: np.ndarray) -> np.ndarray:
    return np.where(valid, 0.0, HIDDEN).astype(np.float32)
