"""What a step reads out per computed position. Plain data (no JAX), shared by every backend."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Readout:
    """kind: "argmax" (token + log-probability, cheap to read back) or "logits" (float32, full vocab).
    cfg: batch rows are (conditional, unconditional), combined into one row of guided logits."""

    kind: str = "argmax"
    cfg: bool = False


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What every backend's step returns: the readout on the host, proposed K/V on the device."""

    readout: dict    # numpy: {"x0", "logp"} or {"logits"}, rows [B', W]
    keys: object     # proposed K [N, B, W, K, hd]
    values: object   # proposed V [N, B, W, K, hd]


@dataclasses.dataclass(frozen=True)
class TokenBiases:
    """Per-vocabulary additive biases (0 or -inf), runtime inputs of every step.

    logit_bias: added to the logits before anything else (-inf: never predicted, e.g. EOS).
    confidence_bias: added before the confidence softmax (-inf: predicting it gives confidence 0).
    """

    logit_bias: np.ndarray       # [E] float32
    confidence_bias: np.ndarray  # [E] float32

    @classmethod
    def build(cls, vocab: int, forbid_ids=(), unconfident_ids=()) -> "TokenBiases":
        logit_bias = np.zeros(vocab, np.float32)
        logit_bias[list(forbid_ids)] = -np.inf
        confidence_bias = np.zeros(vocab, np.float32)
        confidence_bias[list(unconfident_ids)] = -np.inf
        return cls(logit_bias, confidence_bias)
