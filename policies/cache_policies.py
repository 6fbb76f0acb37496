"""What each step computes: the whole canvas (vanilla), or a window against cached K/V.

K/V enter the cache only where a plan says so (`keep_kv`), here at block starts: Fast-dLLM's caches
are refreshed by one full step per block. Every step reads out only the current block's masks: the rule
commits nothing else, so the LM head runs on those positions alone.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, get_args

import numpy as np

from policies.canvas import Block, Canvas
from policies.policy import StepPlan, WithoutSidePath


@dataclasses.dataclass(frozen=True)
class Vanilla(WithoutSidePath):
    """LLaDA's reference: every step runs the whole canvas; nothing is cached; a block takes exactly
    the fixed schedule's steps."""

    name: ClassVar[str] = "vanilla"

    @property
    def stops_when_filled(self) -> bool:
        return False

    def plan(self, canvas: Canvas, block: Block, step: int, kv) -> StepPlan:
        return StepPlan(reads=(block.start, block.end))


class Cached(WithoutSidePath):
    """Fast-dLLM's caches: a full step at each block start commits the K/V `kv_kept` names; later steps run a
    window from the block start to `window_end` against the cache. Both loops take these two decisions from
    here: the host loop's plans (numpy) and the compiled loop (`policies.decode_loop`, jax.numpy)."""

    window_to_end: ClassVar[bool]  # the window runs to the canvas end (else it is the block alone)

    @property
    def stops_when_filled(self) -> bool:
        return True

    def kv_kept(self, positions, block_start):
        """Which of `positions` the block-start step caches."""
        return positions < block_start if self.window_to_end else positions >= 0

    def window_end(self, block_end, length):
        """Where a later step's window ends (exclusive): the canvas `length`, or the block's end."""
        return length if self.window_to_end else block_end

    def plan(self, canvas: Canvas, block: Block, step: int, kv) -> StepPlan:
        if step == 0:
            return StepPlan(keep_kv=self.kv_kept(np.arange(canvas.padded_length), block.start),
                            reads=(block.start, block.end))
        window = np.arange(block.start, self.window_end(block.end, canvas.length))
        return StepPlan(window, reads=(block.start, block.end))


@dataclasses.dataclass(frozen=True)
class PrefixCache(Cached):
    """Fast-dLLM's prefix cache: a full step at each block start caches K/V of everything before the
    block; later steps run the block and everything after it against that prefix."""

    name: ClassVar[str] = "prefix-cache"
    window_to_end: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class DualCache(Cached):
    """Fast-dLLM's dual cache: the block-start step caches K/V of the whole canvas (the part after the
    block goes stale); later steps run only the block."""

    name: ClassVar[str] = "dual-cache"
    window_to_end: ClassVar[bool] = False


CachePolicy = Vanilla | PrefixCache | DualCache
CACHE_POLICIES = {policy.name: policy for policy in get_args(CachePolicy)}
