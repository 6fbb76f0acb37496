"""Explicit, revisable KV state: a value, never mutated. Plain numpy here; the K/V arrays themselves
live on whatever device the backend uses, and the backend writes them.

Invariant: for every batch row r and slot i, `keys[:, r, i]` / `values[:, r, i]` were computed from
token `slot_token[r, i]` by dense forward pass number `slot_nfe[r, i]` (both EMPTY while the slot holds nothing).
A step only *proposes* K/V; a backend's `commit` returns a new state with them written. Comparing
`slot_token` with the canvas tells which slots are stale.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from llada_jax.model.arrays import Array
from llada_jax.system.errors import LladaError

EMPTY = -1
HIDDEN = -1e9  # attention bias of a hidden key; finite, so a row with every key hidden stays NaN-free


class KVState(NamedTuple):
    keys: Array             # [N, B, S, K, hd] device array
    values: Array           # [N, B, S, K, hd] device array
    slot_token: np.ndarray  # [B, S] int32 on host; EMPTY where no K/V is held
    slot_nfe: np.ndarray   # [B, S] int32 on host; EMPTY where no K/V is held

    @property
    def slots(self) -> int:
        return self.slot_token.shape[1]

    @property
    def filled(self) -> np.ndarray:
        return self.slot_token != EMPTY


def empty_records(batch: int, slots: int) -> np.ndarray:
    return np.full((batch, slots), EMPTY, np.int32)


def write_targets(state: KVState, positions: np.ndarray, write: np.ndarray) -> np.ndarray:
    """Slot index per window entry `[B, W]` int32, S where nothing is written; bad slots are refused."""
    positions = np.asarray(positions, np.int64)
    write = np.asarray(write, bool)
    if positions.shape != write.shape:
        raise LladaError("commit: positions and write mask must have the same [B, W] shape")
    targets = positions[write]
    if targets.size and (targets.min() < 0 or targets.max() >= state.slots):
        bad = targets[(targets < 0) | (targets >= state.slots)][0]
        raise LladaError(f"commit: position {int(bad)} is outside the {state.slots} cache slots")
    return np.where(write, positions, state.slots).astype(np.int32)


def with_writes(state: KVState, keys, values, targets: np.ndarray, tokens: np.ndarray, nfe: int) -> KVState:
    """The new state: device arrays already written at `targets`; records updated to match."""
    write = targets < state.slots
    rows = np.nonzero(write)[0]
    slot_token, slot_nfe = state.slot_token.copy(), state.slot_nfe.copy()
    slot_token[rows, targets[write]] = np.asarray(tokens)[write]
    slot_nfe[rows, targets[write]] = nfe
    return KVState(keys, values, slot_token, slot_nfe)


def visible_bias(state: KVState, visible: np.ndarray) -> np.ndarray:
    """Attention bias `[B, S]` float32: 0 for slots a window may attend to (visible and filled)."""
    shown = np.asarray(visible, bool) & state.filled
    return np.where(shown, 0.0, HIDDEN).astype(np.float32)


def stale_slots(state: KVState, canvas: np.ndarray) -> np.ndarray:
    """Filled slots whose K/V was computed from a different token than the canvas now holds."""
    return state.filled & (state.slot_token != np.asarray(canvas))


def window_key_bias(window_valid, window_blocks=None, xp=np):
    """The window's keys' attention bias: invalid positions hidden, `[B, W]`; with `window_blocks` `[B, W]` (each
    position's diffusion block), per query `[B, W, W]`, a later block's keys hidden from an earlier block's
    queries too (block-causal attention). `xp`: numpy, or jax.numpy inside a step."""
    bias = xp.where(window_valid, 0.0, HIDDEN).astype(xp.float32)
    if window_blocks is None:
        return bias
    later = window_blocks[:, None, :] > window_blocks[:, :, None]
    return xp.where(later, HIDDEN, bias[:, None, :]).astype(xp.float32)


def with_context_bias(context_bias, token_bias, xp=np):
    """Every key's bias, the cached slots' `[B, S]` first: `[B, S + W]`, or per query `[B, W, S + W]`."""
    if token_bias.ndim == 3:
        context_bias = xp.broadcast_to(context_bias[:, None, :], token_bias.shape[:2] + context_bias.shape[1:])
    return xp.concatenate([context_bias, token_bias], axis=-1)
