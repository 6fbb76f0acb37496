"""The interface between the decode loop and a policy: what one step computes, commits and drafts.

A policy is a frozen dataclass with three members:
  - `plan(canvas, block, step, kv) -> StepPlan`: what the next dense step of `block` computes;
  - `side_path(backend, canvas)`: a context manager yielding the `Reviser` of one generation (revision's
    side path, which owns a worker thread; `NO_REVISION` otherwise), closed even when a step fails;
  - `stops_when_filled`: a block ends once it has no mask (else after exactly the fixed schedule's steps).
Speculation and revision are policies that widen another policy's plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ContextManager, Protocol

import numpy as np

from llada_jax.model import kv_state
from policies.canvas import Block, Canvas, Window
from policies.decisions import draft_commits, read_rows


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One dense step. `positions` None: the whole canvas (no cached K/V read); else these canvas
    positions in a window of `width` slots (None: the smallest shape bucket that holds them)."""

    positions: np.ndarray | None = None
    width: int | None = None
    keep_kv: np.ndarray | None = None   # [S] bool: canvas positions whose computed K/V the step commits
    drafts: tuple[int, int] = (0, 0)    # canvas positions [start, end) whose masks may be committed early
    draft_threshold: float = 1.0        # ... at this confidence or above
    reads: tuple[int, int] | None = None  # canvas positions [start, end) whose masks' predictions are used; None: all

    @property
    def full(self) -> bool:
        return self.positions is None

    def window(self, canvas: Canvas) -> Window:
        return canvas.full_window() if self.full else canvas.window(self.positions, self.width)

    def read_columns(self, window: Window, canvas: Canvas) -> tuple[int, ...] | None:
        """The window columns the step reads out, when fewer than all: those of `reads` still masked (the
        rule commits masks only, so the LM head runs on them alone), at least the first of `reads`."""
        if self.reads is None:
            return None
        start, end = self.reads
        in_reads = (window.positions >= start) & (window.positions < end) & window.valid
        columns = np.flatnonzero(read_rows(np, in_reads, canvas.masked[window.positions]))
        if columns.size == window.positions.size:
            return None
        return tuple(int(column) for column in columns)

    def draft_positions(self, confidence: np.ndarray, canvas: Canvas) -> np.ndarray:
        """Masked positions of the draft region confident enough to commit now."""
        start, end = self.drafts
        region = np.zeros(canvas.padded_length, bool)
        region[start:end] = True
        return np.flatnonzero(draft_commits(region, canvas.masked, confidence >= self.draft_threshold))

    def useful(self, window: Window, canvas: Canvas, block: Block) -> int:
        """Computed positions whose prediction the step can use: masks of the block or the draft region."""
        real = window.positions[window.valid]
        start, end = self.drafts
        in_block = (real >= block.start) & (real < block.end)
        in_drafts = (real >= start) & (real < end)
        return int(np.sum(canvas.masked[real] & (in_block | in_drafts)))


Revisions = tuple  # ((position, old token, new token), ...)


def write_revisions(tokens: np.ndarray, revisions: Revisions) -> None:
    """Write revised tokens into canvas rows `tokens` `[B, S]` (every row, as a commit writes)."""
    for position, _, new in revisions:
        tokens[:, position] = new


class Reviser(Protocol):
    """Post-step work of one generation: the loop calls `merge` after each dense step computes (before
    its K/V commit), `submit` after its token commits, `finish` after the last step. A reviser reads the canvas
    and never writes it: `merge` and `finish` return their revisions, and the loop writes them."""

    def merge(self, kv: kv_state.KVState, nfe: int) -> tuple[kv_state.KVState, Revisions]: ...

    def submit(self, kv: kv_state.KVState | None, window: Window, confidence: np.ndarray, nfe: int) -> None: ...

    def finish(self, kv: kv_state.KVState | None) -> tuple[kv_state.KVState | None, Revisions]: ...

    def stats(self) -> dict: ...


class NoRevision:
    """The reviser of every policy without a side path: nothing to merge, submit or report."""

    def merge(self, kv, nfe):
        return kv, ()

    def submit(self, kv, window, confidence, nfe) -> None:
        pass

    def finish(self, kv):
        return kv, ()

    def stats(self) -> dict:
        return {}


NO_REVISION = NoRevision()


class Policy(Protocol):
    @property
    def stops_when_filled(self) -> bool: ...

    def plan(self, canvas: Canvas, block: Block, step: int, kv: kv_state.KVState | None) -> StepPlan: ...

    def side_path(self, backend, canvas: Canvas) -> ContextManager[Reviser]: ...


class WithoutSidePath:
    """Mixin of the policies that revise nothing."""

    def side_path(self, backend, canvas: Canvas) -> ContextManager[Reviser]:
        return contextlib.nullcontext(NO_REVISION)
