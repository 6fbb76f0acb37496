"""Dream's `diffusion_generate` at temperature 0 (its `_sample` loop with `sample_tokens`), restated in numpy
from its published semantics over the float64 forward of `tests.reference`: the whole canvas every step,
Dream's shifted logits, its confidence functions, and its per-step count `int(masks * (1 - s / t))` computed
in float32 over `torch.linspace(1, eps, steps + 1)` as torch's CPU kernel fills it."""

from __future__ import annotations

import numpy as np

from tests import reference
from tests.reference import forward

ALGORITHMS = {"maskgit_plus": "low_confidence", "topk_margin": "margin", "entropy": "entropy"}


def torch_linspace_float32(start: float, end: float, count: int) -> np.ndarray:
    """torch's CPU linspace in float32: a float32 step; below count // 2 counted up from start, from there
    down from end; each value one rounding of the exact `base + step * i` (checked against torch 2.13)."""
    step = np.float32((np.float32(end) - np.float32(start)) / np.float32(count - 1))
    i = np.arange(count, dtype=np.float64)
    up = float(np.float32(start)) + float(step) * i
    down = float(np.float32(end)) - float(step) * (count - 1 - i)
    return np.where(i < count // 2, up, down).astype(np.float32)


def filtered(logits: np.ndarray, top_k: int | None, top_p: float | None) -> np.ndarray:
    """`sample_tokens`' filters: top-p (keep the sorted prefix until the cumulative probability passes it, the
    first always), then top-k (keep logits >= the k-th largest); removed logits become float32's lowest."""
    lowest = np.finfo(np.float32).min
    if top_p is not None and top_p < 1:
        order = np.argsort(-logits, axis=-1, kind="stable")
        ordered = np.take_along_axis(logits, order, -1)
        p = np.exp(ordered - ordered[:, :1])
        cumulative = np.cumsum(p / p.sum(-1, keepdims=True), -1)
        remove = np.concatenate([np.zeros_like(cumulative[:, :1], bool), cumulative[:, :-1] > top_p], -1)
        removed = np.zeros_like(remove)
        np.put_along_axis(removed, order, remove, -1)
        logits = np.where(removed, lowest, logits)
    if top_k is not None:
        kth = np.sort(logits, -1)[:, -min(top_k, logits.shape[-1])]
        logits = np.where(logits < kth[:, None], lowest, logits)
    return logits


def confidences(logits: np.ndarray, alg: str, top_k=None, top_p=None) -> tuple[np.ndarray, np.ndarray]:
    logits = filtered(logits, top_k, top_p)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x0 = probs.argmax(-1)
    if alg == "maskgit_plus":
        return probs.max(-1), x0
    if alg == "topk_margin":
        ordered = np.sort(probs, axis=-1)
        return ordered[:, -1] - ordered[:, -2], x0
    return np.sum(probs * np.log(probs + 1e-10), axis=-1), x0


def diffusion_generate(w, cfg, prompt, max_new_tokens: int, steps: int, eps: float, alg: str, top_k=None,
                       top_p=None):
    """The generated ids and forward passes (always `steps`) of one prompt. Called as Dream's code runs under
    transformers 4.x without a `top_k` argument, `top_k` is 50 (its model config's default)."""
    mask = cfg.mask_token_id
    x = np.concatenate([prompt, np.full(max_new_tokens, mask)])[None]
    timesteps = torch_linspace_float32(1.0, eps, steps + 1)
    for i in range(steps):
        masked = x[0] == mask
        logits = forward(w, cfg, x)[0][0]
        confidence, x0 = confidences(logits[masked], alg, top_k, top_p)
        masks = np.float32(masked.sum()) / np.float32(1)
        t, s = timesteps[i], timesteps[i + 1]
        count = int(masks * (np.float32(1.0) - s / t)) if i < steps - 1 else int(masks)
        full = np.full(x.shape[1], -np.inf)
        full[masked] = confidence
        if count > 0:
            chosen = np.argsort(-full, kind="stable")[:count]
            proposal = np.full(x.shape[1], mask)
            proposal[masked] = x0
            x[0, chosen] = proposal[chosen]
    return x[0, len(prompt):], steps


def fast_dllm_generate(w, cfg, prompt, gen_length: int, block_length: int, steps: int, dual: bool,
                       threshold: float | None, eps: float = 1e-3, top_k=50):
    """Fast-dLLM's Dream decoder (`generation_utils_block._sample`): per block a full pass that commits the block's
    first position alone, then cached window steps (the prefix's K/V, or with `dual` every position's, the block
    recomputed in place) whose logits shift within the window; by `threshold` (top-1 probability) or, without
    one, by Dream's schedule over the block's steps on the negative entropy. Returns ids and forward passes."""
    mask = cfg.mask_token_id
    x = np.concatenate([prompt, np.full(gen_length, mask)])[None]
    per_block = steps // (gen_length // block_length)
    timesteps = torch_linspace_float32(1.0, eps, per_block + 1)
    nfe = 0
    for start in range(len(prompt), len(prompt) + gen_length, block_length):
        end = start + block_length
        logits, presents = forward(w, cfg, x)
        x[0, start] = logits[0, start].argmax()
        past = presents if dual else [(k[:, :, :start], v[:, :, :start]) for k, v in presents]
        nfe, i = nfe + 1, 1
        passes = 0
        while (x[0, start:end] == mask).any():
            passes += 1
            if passes > reference.GIVE_UP:
                raise reference.NeverEnds
            window = forward(w, cfg, x[:, start:end], past, replace=(start, end)) if dual else \
                forward(w, cfg, x[:, start:], past)
            logits, nfe = window[0][0][:block_length], nfe + 1
            masked = x[0, start:end] == mask
            alg = "maskgit_plus" if threshold is not None else "entropy"
            confidence, x0 = confidences(logits[masked], alg, top_k)
            full = np.full(block_length, -np.inf)
            full[masked] = confidence
            order = np.argsort(-full, kind="stable")
            if threshold is not None:
                chosen = [order[0]] + [j for j in order[1: int(masked.sum())] if full[j] >= threshold]
            else:
                masks = np.float32(masked.sum())
                count = int(masks * (np.float32(1.0) - timesteps[i + 1] / timesteps[i])) if i < per_block - 1 \
                    else int(masks)
                chosen, i = order[:count], i + 1
            proposal = np.full(block_length, mask)
            proposal[masked] = x0
            x[0, start + np.asarray(chosen, int)] = proposal[np.asarray(chosen, int)]
    return x[0, len(prompt):], nfe
