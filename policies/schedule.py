"""Which masked positions to commit in a step: LLaDA's fixed schedule or Fast-dLLM's threshold rule.

Candidates are ranked by confidence, highest first; equal confidences go to the lower position.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llada_jax.errors import LladaError


def transfer_counts(masked: int, steps: int) -> np.ndarray:
    """Tokens to commit at each of `steps` steps: masked // steps, one more on the first masked % steps."""
    counts = np.full(steps, masked // steps, np.int64)
    counts[: masked % steps] += 1
    return counts


def rank(confidence: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Candidate positions, most confident first (stable: ties keep position order)."""
    positions = np.flatnonzero(candidates)
    order = np.argsort(-confidence[positions], kind="stable")
    return positions[order]


@dataclasses.dataclass(frozen=True)
class FixedSchedule:
    """Commit exactly `counts[step]` tokens: LLaDA's reference schedule."""

    steps_per_block: int

    def select(self, confidence: np.ndarray, candidates: np.ndarray, step: int, counts: np.ndarray) -> np.ndarray:
        return rank(confidence, candidates)[: int(counts[step])]


@dataclasses.dataclass(frozen=True)
class ThresholdRule:
    """Commit every candidate with confidence >= threshold, and always at least the most confident one."""

    threshold: float

    def __post_init__(self):
        if not 0.0 < self.threshold <= 1.0:
            raise LladaError(f"threshold must be in (0, 1], got {self.threshold}")

    def select(self, confidence: np.ndarray, candidates: np.ndarray, step: int, counts: np.ndarray) -> np.ndarray:
        ranked = rank(confidence, candidates)
        if ranked.size == 0:
            return ranked
        keep = confidence[ranked] >= self.threshold
        keep[0] = True
        return ranked[keep]
