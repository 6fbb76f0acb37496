"""Turn a step's readout into (x0, confidence) per computed position, as LLaDA's and Dream's references do.

Temperature 0: x0 is the argmax, computed on the device with its log-probability. Temperature > 0:
Gumbel-max over float64 logits on the host. Confidence is the softmax probability of x0
(`low_confidence`, Dream's `maskgit_plus`), a uniform draw (`random`), or from the float32 probabilities as
Dream's `sample_tokens` computes them (`policies.dream_sampling`): top-1 minus top-2 (`margin`, its
`topk_margin`) or the negative entropy (`entropy`); so are all three under Dream's top-k / top-p filters.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import numpy as np

from llada_jax.model.readout import Readout, ReadoutKind
from llada_jax.system.errors import LladaError
from policies import dream_sampling

# Which masks a step commits first: the most confident (LLaDA), random ones, or by Dream's margin or entropy.
Remasking = Literal["low_confidence", "random", "margin", "entropy"]
REMASKING: tuple[str, ...] = get_args(Remasking)
FROM_PROBABILITIES = ("margin", "entropy")  # confidences computed from a logits readout on the host


@dataclasses.dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0
    remasking: Remasking = "low_confidence"
    unconfident_ids: tuple[int, ...] = ()  # confidence 0 when predicted, and left out of the softmax
    top_k: int | None = None    # Dream's filters before its confidence softmax (None: off)
    top_p: float | None = None

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise LladaError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise LladaError(f"top_k must be a non-negative integer (0: off), got {self.top_k!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise LladaError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.remasking not in REMASKING:
            raise LladaError(f"unknown remasking {self.remasking!r}; choose one of {', '.join(REMASKING)}")

    @property
    def dream_confidence(self) -> bool:
        """Confidence from Dream's float32 probabilities on the host (its confidences, or its filters on)."""
        filtered = bool(self.top_k) or (self.top_p is not None and self.top_p < 1.0)
        return self.remasking in FROM_PROBABILITIES or (filtered and self.remasking == "low_confidence")

    @property
    def readout_kind(self) -> ReadoutKind:
        return "argmax" if self.temperature == 0.0 and not self.dream_confidence else "logits"

    def choose(self, readout: Readout, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x0, confidence (float64) and the order key candidates are ranked by, for every position of row 0
        of the readout. The key is the confidence, except for an argmax readout ranked by confidence: there
        it is the log-probability the device computed (see `policies.schedule`)."""
        if self.dream_confidence:
            x0, confidence = self._dream_confidence(readout.logits[0], rng)
            order = confidence.astype(np.float64)
        elif readout.logits is not None:
            x0, confidence = self._sample(readout.logits[0].astype(np.float64), rng)
            order = confidence
        else:
            order = readout.logp[0].astype(np.float64)
            x0, confidence = readout.x0[0].astype(np.int64), np.exp(order)
        if self.remasking == "random":
            confidence = order = rng.random(x0.shape[0])
        return x0, confidence, order

    def _dream_confidence(self, logits: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """x0 (the argmax of Dream's probabilities; sampled at temperature > 0) and its float32 confidence."""
        scored = logits.astype(np.float32)
        scored[:, list(self.unconfident_ids)] = -np.inf
        probs = dream_sampling.probabilities(scored, self.temperature, self.top_k, self.top_p)
        x0 = (self._sample(logits.astype(np.float64), rng)[0] if self.temperature > 0.0
              else np.argmax(probs, axis=-1))
        return x0, dream_sampling.confidence(probs, x0, self.remasking)

    def _sample(self, logits: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        # argmax of exp(l) / (-log u)^T, taken in log space so large logits cannot overflow.
        with np.errstate(divide="ignore"):
            noisy = logits - self.temperature * np.log(-np.log(rng.random(logits.shape)))
        x0 = np.argmax(noisy, axis=-1)
        scored = logits.copy()
        scored[:, list(self.unconfident_ids)] = -np.inf
        top = scored.max(axis=-1, keepdims=True)
        probs = np.exp(scored - top)
        probs /= probs.sum(axis=-1, keepdims=True)
        return x0, np.take_along_axis(probs, x0[:, None], axis=-1)[:, 0]
