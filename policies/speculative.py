"""Multi-block speculative decoding: fill a fixed-shape step's idle slots with masked positions of the
next block(s) and commit those *drafts* early when the model is already sure of them.

Late in a block few masks remain, yet the window step costs the same. Here the window holds the
current block and then, in order, masked positions of up to `lookahead` following blocks. Current-
block commits follow the base rule; a draft is committed only at confidence >= `draft_threshold`,
since its own context is not final. Uncommitted drafts are discarded, not kept as hints: a hint
from a stale context would bias the block when it becomes current, and the next step recomputes it
anyway. A block that starts with drafts already committed simply has fewer masks to fill.

Over `vanilla` and `prefix-cache` the drafts' predictions already exist (those steps compute every
later position); over `dual-cache` the window widens to `width` slots to hold them.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from llada_jax.errors import LladaError
from llada_jax.shapes import bucket
from policies.cache_policies import CachePolicy, DualCache, run_window
from policies.canvas import Block, Canvas, Window


@dataclasses.dataclass(frozen=True)
class Speculative(CachePolicy):
    base: CachePolicy = DualCache()
    lookahead: int = 3             # following blocks whose masked positions may be drafted
    draft_threshold: float = 0.9   # a draft is committed early only at this confidence or above
    width: int = 0                 # window slots over dual-cache; 0 = a bucket of twice the block length

    name: ClassVar[str] = "speculative"

    def __post_init__(self):
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise LladaError(f"lookahead must be a non-negative integer, got {self.lookahead!r}")
        if not 0.0 < self.draft_threshold <= 1.0:
            raise LladaError(f"draft threshold must be in (0, 1], got {self.draft_threshold}")
        if self.width < 0:
            raise LladaError(f"speculative window width must be >= 0, got {self.width}")

    @property
    def uses_cache(self) -> bool:
        return self.base.uses_cache

    @property
    def stops_when_filled(self) -> bool:
        return self.lookahead > 0 or self.base.stops_when_filled

    def initial_state(self, backend, canvas: Canvas):
        return self.base.initial_state(backend, canvas)

    def draft_region(self, canvas: Canvas, block: Block) -> tuple[int, int]:
        """Canvas positions [start, end) whose masks may be drafted while `block` is current."""
        return block.end, min(block.end + self.lookahead * (block.end - block.start), canvas.length)

    def step(self, backend, canvas: Canvas, state, block: Block, step: int, nfe: int):
        if step == 0 or self.lookahead == 0 or not isinstance(self.base, DualCache):
            return self.base.step(backend, canvas, state, block, step, nfe)
        out, window = run_window(backend, canvas, state, *self.window_plan(canvas, block))
        return out, window, state

    def window_plan(self, canvas: Canvas, block: Block):
        """Over dual-cache: the block, then masked positions of the draft region, in `width` slots."""
        if self.lookahead == 0 or not isinstance(self.base, DualCache):
            return self.base.window_plan(canvas, block)
        length = block.end - block.start
        width = bucket(self.width or 2 * length, canvas.slots)
        start, end = self.draft_region(canvas, block)
        drafts = start + np.flatnonzero(canvas.masked[start:end])
        return np.concatenate([np.arange(block.start, block.end), drafts[: max(0, width - length)]]), width

    def drafts(self, x0: np.ndarray, confidence: np.ndarray, canvas: Canvas, block: Block) -> np.ndarray:
        start, end = self.draft_region(canvas, block)
        region = np.zeros(canvas.slots, bool)
        region[start:end] = True
        return np.flatnonzero(region & canvas.masked & (confidence >= self.draft_threshold))

    def useful(self, window: Window, canvas: Canvas, block: Block) -> int:
        start, end = self.draft_region(canvas, block)
        real = window.positions[window.valid]
        in_block = (real >= block.start) & (real < block.end)
        in_drafts = (real >= start) & (real < end)
        return int(np.sum(canvas.masked[real] & (in_block | in_drafts)))

    def after_commit(self, backend, canvas, state, block, window, x0, confidence, nfe):
        return self.base.after_commit(backend, canvas, state, block, window, x0, confidence, nfe)

    def finish(self, backend, canvas, state):
        return self.base.finish(backend, canvas, state)

    def stats(self, state) -> dict:
        return self.base.stats(state)
