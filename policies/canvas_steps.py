"""The backend calls a policy makes over a canvas, made at once or as `BackendCall`s for a driver: a window step
against cached K/V, and the commit of a step's K/V; and the spreading of a window's predictions over canvas
positions."""

from __future__ import annotations

import numpy as np

from llada_jax.model import kv_state
from llada_jax.model.readout import StepOutput
from policies.backend import BackendCall
from policies.canvas import Canvas, Window


def window_step(backend, canvas: Canvas, kv: kv_state.KVState, window: Window, reads=None) -> StepOutput:
    """Compute the window's positions against every other filled position of the canvas (the window's
    own positions are computed in it, never read from the cache); read out the columns `reads`."""
    return window_call(canvas, kv, window, reads).run(backend)


def window_call(canvas: Canvas, kv: kv_state.KVState, window: Window, reads=None) -> BackendCall:
    """The backend call of `window_step`."""
    rows = canvas.tokens.shape[0]
    visible = canvas.valid.copy()
    visible[:, window.positions[window.valid]] = False
    positions = np.broadcast_to(canvas.rotary_positions(window.positions), (rows, len(window.positions)))
    valid = np.broadcast_to(window.valid, positions.shape)
    return BackendCall("window", (kv, visible, canvas.tokens[:, window.positions], positions, valid, reads))


def commit_window(backend, kv: kv_state.KVState, window: Window, keep: np.ndarray, out: StepOutput,
                  tokens: np.ndarray, nfe: int) -> kv_state.KVState:
    """Write `out`'s K/V at the window's real positions where `keep` `[W]`, recorded as computed from
    `tokens` `[B, W]` (the window's tokens when the step ran)."""
    return commit_call(kv, window, keep, out, tokens, nfe).run(backend)


def commit_call(kv: kv_state.KVState, window: Window, keep: np.ndarray, out: StepOutput, tokens: np.ndarray,
                nfe: int) -> BackendCall:
    """The backend call of `commit_window`."""
    positions = np.broadcast_to(window.positions, (tokens.shape[0], len(window.positions)))
    return BackendCall("commit", (kv, positions, np.broadcast_to(window.valid & keep, positions.shape), out, tokens,
                                  nfe))


def canvas_wide(canvas: Canvas, window: Window, x0: np.ndarray, confidence: np.ndarray):
    """Spread per-window predictions over canvas positions (confidence -inf where not computed)."""
    x0_all = np.full(canvas.padded_length, canvas.mask_id, np.int64)
    confidence_all = np.full(canvas.padded_length, -np.inf)
    real = window.positions[window.valid]
    x0_all[real] = x0[window.valid]
    confidence_all[real] = confidence[window.valid]
    return x0_all, confidence_all
