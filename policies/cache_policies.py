"""What each step computes: the whole canvas (vanilla), or a window against cached K/V.

A cache policy runs one step for step `step` of `block`, returns the step output, the window it
computed and its new state (the KV state here). K/V are committed only at block starts, explicitly.
Hooks with defaults in `CachePolicy` let later policies add draft commits and post-step work.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from llada_jax import kv_state
from policies.canvas import Block, Canvas, Window


def run_full(backend, canvas: Canvas):
    return backend.full(canvas.tokens, canvas.valid), canvas.full_window()


def run_window(backend, canvas: Canvas, state: kv_state.KVState, positions, width: int | None = None):
    """Compute `positions` (padded to `width`) against every other filled slot of the canvas."""
    window = canvas.window(positions, width)
    visible = canvas.valid.copy()
    visible[:, window.positions[window.valid]] = False
    rows = canvas.tokens.shape[0]
    ids = canvas.tokens[:, window.positions]
    out = backend.window(state, visible, ids, np.broadcast_to(window.positions, (rows, len(window.positions))),
                         np.broadcast_to(window.valid, (rows, len(window.valid))))
    return out, window


def commit_window(backend, state: kv_state.KVState, out, window: Window, canvas: Canvas, keep: np.ndarray,
                  step: int) -> kv_state.KVState:
    """Write the proposed K/V of the window positions where `keep` `[W]` holds."""
    rows = canvas.tokens.shape[0]
    positions = np.broadcast_to(window.positions, (rows, len(window.positions)))
    write = np.broadcast_to(window.valid & keep, positions.shape)
    return backend.commit(state, positions, write, out, canvas.tokens[:, window.positions], step)


class CachePolicy:
    """Defaults of the hooks the decode loop calls around `step`."""

    @property
    def stops_when_filled(self) -> bool:
        """A block ends once it has no mask (else: after exactly steps_per_block steps, as LLaDA's reference)."""
        return self.uses_cache

    def initial_state(self, backend, canvas: Canvas):
        return backend.empty_state(canvas.tokens.shape[0], canvas.slots) if self.uses_cache else None

    def drafts(self, x0: np.ndarray, confidence: np.ndarray, canvas: Canvas, block: Block) -> np.ndarray:
        """Masked positions beyond the current block to commit early (none by default)."""
        return np.zeros(0, np.int64)

    def after_commit(self, backend, canvas: Canvas, state, block: Block, window: Window, x0, confidence, nfe: int):
        """Work after the step's commits (the revision policy's side path). Returns (state, revisions)."""
        return state, ()

    def finish(self, backend, canvas: Canvas, state):
        """Work after the last step (the revision policy merges its last side job). Returns (state, revisions)."""
        return state, ()

    def stats(self, state) -> dict:
        """Per-generation counters of the policy (the revision policy's side path)."""
        return {}

    def useful(self, window: Window, canvas: Canvas, block: Block) -> int:
        """Window positions whose prediction this step can use: masked positions of the current block."""
        real = window.positions[window.valid]
        return int(np.sum(canvas.masked[real] & (real >= block.start) & (real < block.end)))


@dataclasses.dataclass(frozen=True)
class Vanilla(CachePolicy):
    """LLaDA's reference: every step runs the whole canvas; nothing is cached."""

    name: ClassVar[str] = "vanilla"
    uses_cache: ClassVar[bool] = False

    def step(self, backend, canvas: Canvas, state, block: Block, step: int, nfe: int):
        out, window = run_full(backend, canvas)
        return out, window, state


@dataclasses.dataclass(frozen=True)
class PrefixCache(CachePolicy):
    """Fast-dLLM's prefix cache: a full step at each block start caches K/V of everything before the
    block; later steps run the block and everything after it against that prefix."""

    name: ClassVar[str] = "prefix-cache"
    uses_cache: ClassVar[bool] = True

    def step(self, backend, canvas: Canvas, state, block: Block, step: int, nfe: int):
        if step == 0:
            out, window = run_full(backend, canvas)
            return out, window, commit_window(backend, state, out, window, canvas, window.positions < block.start, nfe)
        out, window = run_window(backend, canvas, state, *self.window_plan(canvas, block))
        return out, window, state

    def window_plan(self, canvas: Canvas, block: Block):
        """(positions, width) of a window step: the block and everything after it."""
        return np.arange(block.start, canvas.length), None


@dataclasses.dataclass(frozen=True)
class DualCache(CachePolicy):
    """Fast-dLLM's dual cache: the block-start step caches K/V of the whole canvas (the part after the
    block goes stale); later steps run only the block."""

    name: ClassVar[str] = "dual-cache"
    uses_cache: ClassVar[bool] = True

    def step(self, backend, canvas: Canvas, state, block: Block, step: int, nfe: int):
        if step == 0:
            out, window = run_full(backend, canvas)
            return out, window, commit_window(backend, state, out, window, canvas, np.ones(len(window.positions), bool), nfe)
        out, window = run_window(backend, canvas, state, *self.window_plan(canvas, block))
        return out, window, state

    def window_plan(self, canvas: Canvas, block: Block):
        """(positions, width) of a window step: the block only."""
        return np.arange(block.start, block.end), None


CACHE_POLICIES = {policy.name: policy for policy in (Vanilla, PrefixCache, DualCache)}
