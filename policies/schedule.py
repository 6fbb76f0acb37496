"""The lengths of one generation, and which masked positions to commit in a step: LLaDA's fixed
schedule, Fast-dLLM's threshold rule, or Dream's (`policies.dream_schedule`).

The rules themselves are `policies.decisions`, which the compiled loop calls too; here they are chosen and
applied to one block. Candidates are ranked by an order key, highest first; equal keys go to the lower
position. The key is
the confidence itself, except at temperature 0 where it is the step's float32 log-probability: its order
is exactly what a compiled loop on the device computes (exp in float64 can tie distinct values near 1).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llada_jax.system.errors import LladaError
from policies.canvas import Block
from policies.decisions import fixed_commits, scheduled_count, threshold_commits
from policies.dream_schedule import DreamSchedule, FirstTokenFirst
from policies.rule import Rule

MAX_COUNT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Lengths of one generation, validated as LLaDA's reference requires."""

    gen_length: int
    block_length: int
    steps: int

    def __post_init__(self):
        for name in ("gen_length", "block_length", "steps"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise LladaError(f"{name} must be a positive integer, got {value!r}")
            if value > MAX_COUNT:  # the compiled loops count in int32
                raise LladaError(f"{name}={value} is more than this decoder counts ({MAX_COUNT})")
        if self.gen_length % self.block_length:
            raise LladaError(f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}")
        if self.steps < self.num_blocks:
            raise LladaError(f"steps={self.steps} is fewer than the {self.num_blocks} blocks "
                             "(need one step per block at least)")
        if self.steps % self.num_blocks:
            raise LladaError(f"steps={self.steps} is not divisible by the number of blocks ({self.num_blocks})")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def blocks(self, prompt_len: int) -> list[Block]:
        return [Block(b, prompt_len + b * self.block_length, prompt_len + (b + 1) * self.block_length)
                for b in range(self.num_blocks)]


def in_rank_order(rank: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """The positions of `chosen`, first-ranked first (`rank` from `policies.decisions.ranks`)."""
    positions = np.flatnonzero(chosen)
    return positions[np.argsort(rank[positions], kind="stable")]


@dataclasses.dataclass(frozen=True)
class FixedSchedule:
    """Commit the scheduled count of tokens each step: LLaDA's reference schedule."""

    steps_per_block: int

    @property
    def fixed_steps(self) -> int:
        """Steps a block takes under a policy that does not stop once the block is filled."""
        return self.steps_per_block

    def commits(self, rank: np.ndarray, candidates: np.ndarray, confidence: np.ndarray, step: int,
                masked_at_start: int) -> np.ndarray:
        return fixed_commits(rank, candidates, scheduled_count(masked_at_start, self.steps_per_block, step))


@dataclasses.dataclass(frozen=True)
class ThresholdRule:
    """Commit every candidate with confidence >= threshold, and always at least the most confident one."""

    threshold: float

    def __post_init__(self):
        if not 0.0 < self.threshold <= 1.0:
            raise LladaError(f"threshold must be in (0, 1], got {self.threshold}")

    @property
    def fixed_steps(self) -> None:
        return None

    def commits(self, rank: np.ndarray, candidates: np.ndarray, confidence: np.ndarray, step: int,
                masked_at_start: int) -> np.ndarray:
        return threshold_commits(rank, candidates, confidence >= self.threshold)


SCHEDULES = ("llada", "dream")  # how many tokens a step commits (without a threshold): `--schedule NAME[:EPS]`


def make_rule(schedule: Schedule, threshold: float | None, transfer: str = "llada",
              first_token: bool = False) -> Rule:
    """The commit rule: the threshold rule when one is given, else the `transfer` schedule (`llada`, or
    `dream[:EPS]`, eps 1e-3 by default as in Dream's generation config). `first_token`: a block's first step
    commits its first position alone (Fast-dLLM's Dream decoder, `FirstTokenFirst`)."""
    rule = _rule(schedule, threshold, transfer)
    return FirstTokenFirst(rule) if first_token else rule


def _rule(schedule: Schedule, threshold: float | None, transfer: str) -> Rule:
    """The threshold rule when one is given, else the schedule `transfer` names (checked either way)."""
    name, colon, eps = transfer.partition(":")
    if name not in SCHEDULES or (colon and name != "dream"):
        raise LladaError(f"unknown schedule {transfer!r}; choose llada or dream[:EPS]")
    try:
        steps = (FixedSchedule(schedule.steps_per_block) if name == "llada"
                 else DreamSchedule(schedule.steps_per_block, float(eps) if colon else 1e-3))
    except ValueError:
        raise LladaError(f"bad eps in schedule {transfer!r}; use dream:EPS, e.g. dream:0.001") from None
    return steps if threshold is None else ThresholdRule(float(threshold))
