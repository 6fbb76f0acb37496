"""What each step computes: the whole canvas (vanilla), or a window against cached K/V.

K/V enter the cache only where a plan says so (`keep_kv`), here at block starts: Fast-dLLM's caches
are refreshed by one full step per block. Every step reads out only the current block's masks: the rule
commits nothing else, so the LM head runs on those positions alone.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from policies.canvas import Block, Canvas
from policies.policy import StepPlan, WithoutSidePath


@dataclasses.dataclass(frozen=True)
class Vanilla(WithoutSidePath):
    """LLaDA's reference: every step runs the whole canvas; nothing is cached; a block takes exactly
    the fixed schedule's steps."""

    name: ClassVar[str] = "vanilla"
    stops_when_filled: ClassVar[bool] = False

    def plan(self, canvas: Canvas, block: Block, step: int, kv) -> StepPlan:
        return StepPlan(reads=(block.start, block.end))


@dataclasses.dataclass(frozen=True)
class PrefixCache(WithoutSidePath):
    """Fast-dLLM's prefix cache: a full step at each block start caches K/V of everything before the
    block; later steps run the block and everything after it against that prefix."""

    name: ClassVar[str] = "prefix-cache"
    stops_when_filled: ClassVar[bool] = True

    def plan(self, canvas: Canvas, block: Block, step: int, kv) -> StepPlan:
        if step == 0:
            return StepPlan(keep_kv=np.arange(canvas.padded_length) < block.start, reads=(block.start, block.end))
        return StepPlan(np.arange(block.start, canvas.length), reads=(block.start, block.end))


@dataclasses.dataclass(frozen=True)
class DualCache(WithoutSidePath):
    """Fast-dLLM's dual cache: the block-start step caches K/V of the whole canvas (the part after the
    block goes stale); later steps run only the block."""

    name: ClassVar[str] = "dual-cache"
    stops_when_filled: ClassVar[bool] = True

    def plan(self, canvas: Canvas, block: Block, step: int, kv) -> StepPlan:
        if step == 0:
            return StepPlan(keep_kv=np.ones(canvas.padded_length, bool), reads=(block.start, block.end))
        return StepPlan(np.arange(block.start, block.end), reads=(block.start, block.end))


CACHE_POLICIES = {policy.name: policy for policy in (Vanilla, PrefixCache, DualCache)}
