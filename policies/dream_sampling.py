"""Dream's `sample_tokens` on the host, in float32 as its reference computes it: logits scaled by the
temperature, filtered by top-p then top-k (removed logits set to float32's lowest value), a softmax, and the
confidence of each position's prediction: its probability (`maskgit_plus`, our `low_confidence`), the top-1
minus top-2 margin (`topk_margin`), or the negative entropy (`entropy`)."""

from __future__ import annotations

import numpy as np

LOWEST = np.finfo(np.float32).min


def top_p_filter(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the most likely logits until their cumulative probability passes `top_p` (the first always)."""
    order = np.argsort(-logits, axis=-1, kind="stable")
    ordered = np.take_along_axis(logits, order, axis=-1)
    exps = np.exp(ordered - ordered[:, :1])
    cumulative = np.cumsum(exps / exps.sum(axis=-1, keepdims=True, dtype=np.float32), axis=-1, dtype=np.float32)
    remove = np.zeros_like(cumulative, dtype=bool)
    remove[:, 1:] = cumulative[:, :-1] > top_p
    out = logits.copy()
    np.put_along_axis(out, order, np.where(remove, LOWEST, ordered), axis=-1)
    return out


def top_k_filter(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Keep the logits at least the k-th largest (ties at the k-th all kept)."""
    kth = -np.partition(-logits, min(top_k, logits.shape[-1]) - 1, axis=-1)[:, min(top_k, logits.shape[-1]) - 1]
    return np.where(logits < kth[:, None], LOWEST, logits)


def probabilities(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None) -> np.ndarray:
    scored = logits.astype(np.float32)
    if temperature > 0.0:
        scored = scored / np.float32(temperature)
    if top_p is not None and top_p < 1.0:
        scored = top_p_filter(scored, top_p)
    if top_k:
        scored = top_k_filter(scored, top_k)
    exps = np.exp(scored - scored.max(axis=-1, keepdims=True))
    return exps / exps.sum(axis=-1, keepdims=True, dtype=np.float32)


def confidence(probs: np.ndarray, x0: np.ndarray, kind: str) -> np.ndarray:
    """Float32 confidence of predicting `x0` from `probs` (`kind`: low_confidence, margin or entropy)."""
    if kind == "margin":
        top2 = np.partition(probs, -2, axis=-1)[:, -2:]
        return top2[:, 1] - top2[:, 0]
    if kind == "entropy":
        return np.asarray(np.sum(probs * np.log(probs + np.float32(1e-10)), axis=-1, dtype=np.float32))
    return np.take_along_axis(probs, x0[:, None], axis=-1)[:, 0]
