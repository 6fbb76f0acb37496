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

import numpy as np

from llada_jax.system.errors import LladaError
from policies.cache_policies import DualCache
from policies.canvas import Block, Canvas
from policies.decisions import speculative_width, speculative_window
from policies.policy import Policy, StepPlan


@dataclasses.dataclass(frozen=True)
class Speculative:
    base: Policy = DualCache()
    lookahead: int = 3             # following blocks whose masked positions may be drafted
    draft_threshold: float = 0.9   # a draft is committed early only at this confidence or above
    width: int = 0                 # window slots over dual-cache; 0 = a bucket of twice the block length

    def __post_init__(self):
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise LladaError(f"lookahead must be a non-negative integer, got {self.lookahead!r}")
        if not 0.0 < self.draft_threshold <= 1.0:
            raise LladaError(f"draft threshold must be in (0, 1], got {self.draft_threshold}")
        if self.width < 0:
            raise LladaError(f"speculative window width must be >= 0, got {self.width}")

    @property
    def stops_when_filled(self) -> bool:
        return self.lookahead > 0 or self.base.stops_when_filled

    def side_path(self, backend, canvas: Canvas):
        return self.base.side_path(backend, canvas)

    def plan(self, canvas: Canvas, block: Block, step: int, kv) -> StepPlan:
        """The base plan with the draft region; over dual-cache its window steps widen to hold drafts."""
        plan = self.base.plan(canvas, block, step, kv)
        start, end = self.draft_region(canvas, block)
        if not plan.full and self.lookahead and isinstance(self.base, DualCache):
            length = block.end - block.start
            width = speculative_width(length, self.width, canvas.padded_length)
            region = np.zeros(canvas.padded_length, bool)
            region[start:end] = True
            positions, valid = speculative_window(np, block.start, length, region & canvas.masked, width)
            plan = dataclasses.replace(plan, width=width, positions=positions[valid])
        reads = None if self.lookahead else plan.reads  # drafts are read out beyond the block
        return dataclasses.replace(plan, drafts=(start, end), draft_threshold=self.draft_threshold, reads=reads)

    def draft_region(self, canvas: Canvas, block: Block) -> tuple[int, int]:
        """Canvas positions [start, end) whose masks may be drafted while `block` is current."""
        return block.end, min(block.end + self.lookahead * (block.end - block.start), canvas.length)
