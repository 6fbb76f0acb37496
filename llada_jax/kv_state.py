"""Explicit, revisable KV state: a value, never mutated.

Invariant: for every batch row r and slot i, `keys[:, r, i]` / `values[:, r, i]` were computed from
token `slot_token[r, i]` at decoding step `slot_step[r, i]` (both -1 while the slot is empty). A step
only *proposes* K/V; `commit` returns a new state with them written. Comparing `slot_token` with the
canvas tells which slots are stale.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from llada_jax.config import LLaDAConfig
from llada_jax.errors import LladaError
from llada_jax.model import HIDDEN, Context

EMPTY = -1


class KVState(NamedTuple):
    keys: jax.Array         # [N, B, S, K, hd] on device
    values: jax.Array       # [N, B, S, K, hd] on device
    slot_token: np.ndarray  # [B, S] int32 on host; EMPTY where no K/V is held
    slot_step: np.ndarray   # [B, S] int32 on host; EMPTY where no K/V is held

    @property
    def slots(self) -> int:
        return self.slot_token.shape[1]

    @property
    def filled(self) -> np.ndarray:
        return self.slot_token != EMPTY


def empty_state(config: LLaDAConfig, batch: int, slots: int, dtype=jnp.float32) -> KVState:
    shape = (config.n_layers, batch, slots, config.n_kv_heads, config.head_dim)
    records = np.full((batch, slots), EMPTY, np.int32)
    return KVState(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), records, records.copy())


@jax.jit
def _scatter(cache: jax.Array, positions: jax.Array, proposed: jax.Array) -> jax.Array:
    rows = jnp.arange(cache.shape[1])[:, None]
    # Out-of-range positions (the host passes S for "do not write") are dropped, never clamped.
    return cache.at[:, rows, positions].set(proposed.astype(cache.dtype), mode="drop")


def commit(state: KVState, positions: np.ndarray, write: np.ndarray, keys: jax.Array, values: jax.Array,
           tokens: np.ndarray, step: int) -> KVState:
    """A new state with the proposed K/V `[N, B, W, K, hd]` of window slots where `write` `[B, W]` holds
    stored at `positions` `[B, W]`, recorded as computed from `tokens` `[B, W]` at `step`."""
    positions = np.asarray(positions, np.int64)
    write = np.asarray(write, bool)
    if positions.shape != write.shape or positions.shape != np.shape(tokens):
        raise LladaError("commit: positions, write mask and tokens must have the same [B, W] shape")
    targets = positions[write]
    if targets.size and (targets.min() < 0 or targets.max() >= state.slots):
        raise LladaError(f"commit: position {int(targets.max())} is outside the {state.slots} cache slots")
    guarded = np.where(write, positions, state.slots).astype(np.int32)
    rows = np.nonzero(write)[0]
    slot_token = state.slot_token.copy()
    slot_step = state.slot_step.copy()
    slot_token[rows, targets] = np.asarray(tokens)[write]
    slot_step[rows, targets] = step
    return KVState(_scatter(state.keys, guarded, keys), _scatter(state.values, guarded, values),
                   slot_token, slot_step)


def context(state: KVState, visible: np.ndarray) -> Context:
    """The cached slots a window may attend to: `visible` `[B, S]` and actually filled."""
    shown = np.asarray(visible, bool) & state.filled
    bias = np.where(shown, 0.0, HIDDEN).astype(np.float32)
    return Context(state.keys, state.values, jnp.asarray(bias))


def stale_slots(state: KVState, canvas: np.ndarray) -> np.ndarray:
    """Filled slots whose K/V was computed from a different token than the canvas now holds."""
    return state.filled & (state.slot_token != np.asarray(canvas))
