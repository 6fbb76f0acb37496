"""Dream's commit rules: the timestep schedule of its `diffusion_generate`, and Fast-dLLM's Dream decoder's
block start (its first step commits the block's first position alone, then the block's own rule runs)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from llada_jax.system.errors import LladaError
from policies.decisions import fixed_commits
from policies.rule import Rule


@functools.cache  # once per (steps, eps), not at every step of a block
def dream_timesteps(steps: int, eps: float) -> np.ndarray:
    """`torch.linspace(1, eps, steps + 1)` in float32 as torch's CPU kernel fills it: a float32 step, the first
    half counted from the start and the second half from the end, each value one rounding of `base + step * i`
    (a fused multiply-add); `jnp.linspace` and `np.linspace` differ from it in the last bit."""
    count = steps + 1
    start, end = np.float32(1.0), np.float32(eps)
    step = np.float32((end - start) / np.float32(count - 1))
    values = np.array([np.float32(float(start) + float(step) * i) if i < count // 2
                       else np.float32(float(end) - float(step) * (count - i - 1)) for i in range(count)], np.float32)
    values.flags.writeable = False  # shared by every caller (cached)
    return values


@dataclasses.dataclass(frozen=True)
class DreamSchedule:
    """Dream's `diffusion_generate` count: at step i of n, int(masks left * (1 - t[i+1] / t[i])) in float32 over
    its timesteps t from 1 to eps; the last step commits every mask left. The steps always run (no early stop)."""

    steps_per_block: int
    eps: float = 1e-3

    def __post_init__(self):
        if not 0.0 <= self.eps < 1.0:
            raise LladaError(f"the dream schedule's eps must be in [0, 1), got {self.eps}")

    @property
    def fixed_steps(self) -> int:
        return self.steps_per_block

    def count(self, masked: int, step: int) -> int:
        if step >= self.steps_per_block - 1:
            return masked
        t = dream_timesteps(self.steps_per_block, self.eps)
        return int(np.float32(masked) * (np.float32(1.0) - t[step + 1] / t[step]))

    def commits(self, rank: np.ndarray, candidates: np.ndarray, confidence: np.ndarray, step: int,
                masked_at_start: int) -> np.ndarray:
        return fixed_commits(rank, candidates, self.count(int(candidates.sum()), step))


@dataclasses.dataclass(frozen=True)
class FirstTokenFirst:
    """A block's first step commits the block's first position (its prediction), nothing else; later steps
    commit by `rule`, their step index counted from that first step (Fast-dLLM's Dream decoder)."""

    rule: Rule

    @property
    def fixed_steps(self) -> int | None:
        return self.rule.fixed_steps

    def commits(self, rank: np.ndarray, candidates: np.ndarray, confidence: np.ndarray, step: int,
                masked_at_start: int) -> np.ndarray:
        if step > 0:
            return self.rule.commits(rank, candidates, confidence, step, masked_at_start)
        first = np.zeros_like(candidates)
        first[0] = candidates[0]
        return first
