"""The forward pass cut into fixed-shape pieces for staged execution: the embedding (a host gather),
one decoder layer taking its weights as a single packed argument, and the final norm + head.

Packed layout: a stage's tensors (one layer's nine, or ln_f + lm_head) flattened one after another,
each starting at a multiple of ALIGN elements, in one contiguous buffer. `unpack` slices it back with
static offsets inside the jitted function, so the same compiled code serves every layer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from llada_jax.config import LLaDAConfig
from llada_jax.kv_state import HIDDEN
from llada_jax.model import decoder_layer, rms_norm, rotary_tables
from llada_jax.params import BLOCK_TENSORS, block_shapes
from llada_jax.readout import Readout
from llada_jax.steps import read_out

ALIGN = 16  # elements: every tensor of a packed stage starts on a 64-byte boundary (float32)


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each tensor of a stage sits in its packed buffer (hashable: a static jit argument)."""

    entries: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, offset in elements)
    size: int                                               # elements, padded to ALIGN

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]]) -> "PackedLayout":
        entries, offset = [], 0
        for name, shape in shapes.items():
            entries.append((name, tuple(shape), offset))
            offset += -(-int(np.prod(shape)) // ALIGN) * ALIGN
        return cls(tuple(entries), offset)

    def pack(self, tensors: dict[str, np.ndarray], dtype) -> np.ndarray:
        """One contiguous, 64-byte aligned host buffer holding every tensor of the stage."""
        raw = np.zeros(self.size * np.dtype(dtype).itemsize + 64, np.uint8)
        start = (-raw.ctypes.data) % 64
        packed = raw[start: start + self.size * np.dtype(dtype).itemsize].view(dtype)
        for name, shape, offset in self.entries:
            packed[offset: offset + int(np.prod(shape))] = np.asarray(tensors[name], dtype).reshape(-1)
        return packed

    def unpack(self, packed: jax.Array) -> dict:
        return {name: packed[offset: offset + int(np.prod(shape))].reshape(shape)
                for name, shape, offset in self.entries}


def layer_layout(config: LLaDAConfig) -> PackedLayout:
    return PackedLayout.of({name: block_shapes(config)[name] for name in BLOCK_TENSORS})


def head_layout(config: LLaDAConfig) -> PackedLayout:
    return PackedLayout.of({"ln_f": (config.d_model,), "lm_head": (config.embedding_size, config.d_model)})


@functools.partial(jax.jit, static_argnames=("config",))
def layer_step(packed: jax.Array, x: jax.Array, positions: jax.Array, key_bias: jax.Array,
               cached_keys, cached_values, *, config: LLaDAConfig):
    """One decoder layer over `x` `[B, W, D]`; cached K/V `[B, S, K, hd]` (or None for a full step)
    come first in the keys, biased by `key_bias` `[B, S + W]` (or `[B, W]`). Returns x, k, v."""
    block = layer_layout(config).unpack(packed)
    rotary = rotary_tables(positions, config.head_dim, config.rope_theta)
    cached = None if cached_keys is None else (cached_keys, cached_values)
    return decoder_layer(block, x, rotary, cached, key_bias, config)


@functools.partial(jax.jit, static_argnames=("config", "readout"))
def head_step(packed: jax.Array, x: jax.Array, cfg_scale, logit_bias, confidence_bias, *,
              config: LLaDAConfig, readout: Readout):
    """Final norm and LM head, then the readout (as the resident steps do)."""
    weights = head_layout(config).unpack(packed)
    hidden = rms_norm(x, weights["ln_f"], config.rms_norm_eps)
    return read_out({"lm_head": weights["lm_head"]}, hidden, cfg_scale, logit_bias, confidence_bias, readout)


def key_bias(valid: np.ndarray) -> np.ndarray:
    return np.where(valid, 0.0, HIDDEN).astype(np.float32)
