"""The commit rule's interface: which of a block's masked positions a step commits."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Rule(Protocol):
    """LLaDA's fixed schedule, Dream's, the threshold rule, or Dream's first-token-first over one of them."""

    @property
    def fixed_steps(self) -> int | None:
        """Steps a block takes under a policy that does not stop once the block is filled; None: the rule's
        own commits end the block (the threshold rule)."""
        ...

    def commits(self, rank: np.ndarray, candidates: np.ndarray, confidence: np.ndarray, step: int,
                masked_at_start: int) -> np.ndarray:
        """[L] bool over the block: which `candidates` (masked positions, ranked by `rank`) step `step` commits;
        `masked_at_start` masks were left when the block began."""
        ...
