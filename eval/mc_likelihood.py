"""A continuation's log-likelihood under LLaDA, estimated as LLaDA's own evaluation does: Monte Carlo over
masked copies of the answer. Each copy masks a number of the continuation's tokens (counts spread evenly
over 1..L from a random start, so every batch covers all mask ratios), the model predicts the masked
tokens from the rest, and the estimate is the mean over copies of the masked tokens' log-probability
weighted by 1 / (fraction masked): the negative of the diffusion loss, a lower bound on log p(answer).

Block diffusion (LLaDA2, `block_length` given) reads each copy as its training bound does (dllm's BD3LM eval,
[x_t ⊕ x_0]): a block of the masked copy attends to itself and to the clean sequence's earlier blocks.
"""

from __future__ import annotations

import zlib

import numpy as np

import llada_jax
from llada_jax.system.errors import LladaError

LOGITS_BYTES = 1 << 30  # logits read back per forward call, at most: rows are cut to fit


def request_rng(seed: int, context: str, continuation: str) -> np.random.Generator:
    """A generator of its own for each (context, continuation): estimates do not depend on request order."""
    return np.random.default_rng([seed, zlib.crc32(f"{context}\0{continuation}".encode())])


def mask_counts(rng: np.random.Generator, length: int, rows: int) -> np.ndarray:
    """Masked tokens per copy, in 1..length: evenly spaced from a random start, wrapping around."""
    start = int(rng.integers(1, length + 1))
    spread = np.round(np.linspace(start, start + (rows - 1) * length / rows, rows)).astype(np.int64)
    return (spread - 1) % length + 1


def masked_copies(rng: np.random.Generator, sequence: np.ndarray, prefix_len: int, counts: np.ndarray,
                  mask_id: int) -> np.ndarray:
    """`[rows, L]` copies of the sequence, copy i with `counts[i]` random continuation tokens masked."""
    copies = np.tile(sequence, (len(counts), 1))
    length = len(sequence) - prefix_len
    for row, count in enumerate(counts):
        copies[row, prefix_len + rng.permutation(length)[:count]] = mask_id
    return copies


def target_log_probs(model, copies: np.ndarray, sequence: np.ndarray, prefix_len: int, cfg_scale: float,
                     block_length: int | None = None) -> np.ndarray:
    """`[rows, L - prefix_len]`: log p(the true token) at every continuation position of every copy (with
    classifier-free guidance, the prompt masked in the unconditional pass; with `block_length`, block-causal
    against the clean sequence's earlier blocks)."""
    per_row = copies.shape[1] * model.config.embedding_size * 4 * (2 if cfg_scale > 0 else 1)
    step = max(1, LOGITS_BYTES // per_row)
    out = []
    for start in range(0, len(copies), step):
        rows = copies[start: start + step]
        if block_length is None:
            logits = llada_jax.logits(model, rows).astype(np.float64)
        else:
            clean = np.broadcast_to(sequence, rows.shape)
            logits = llada_jax.logits(model, rows, block_length, context_ids=clean).astype(np.float64)
        if cfg_scale > 0:
            unconditional = rows.copy()
            unconditional[:, :prefix_len] = model.config.mask_token_id
            plain = llada_jax.logits(model, unconditional).astype(np.float64)
            logits = plain + (cfg_scale + 1.0) * (logits - plain)
        out.append(true_log_probs(logits[:, prefix_len:], sequence[prefix_len:]))
    return np.concatenate(out)


def true_log_probs(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """log softmax(logits)[token] `[rows, L]` for logits `[rows, L, E]` and tokens `[L]`."""
    top = logits.max(-1, keepdims=True)
    log_norm = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    truth = np.take_along_axis(logits, np.broadcast_to(tokens, logits.shape[:2])[..., None], -1)[..., 0]
    return truth - log_norm


def mc_log_likelihood(model, prefix: list[int], target: list[int], mc_num: int, batch: int,
                      rng: np.random.Generator, cfg_scale: float = 0.0, block_length: int | None = None) -> float:
    """The Monte Carlo estimate of log p(target | prefix) from `mc_num` masked copies, `batch` per pass (with
    `block_length`, block diffusion's bound)."""
    if not target:
        raise LladaError("the continuation is empty")
    if block_length is not None and cfg_scale > 0:
        raise LladaError("classifier-free guidance is not part of block diffusion's likelihood bound; drop cfg_scale")
    sequence = np.array(list(prefix) + list(target), np.int64)
    length, mask_id = len(target), model.config.mask_token_id
    estimates = []
    for _ in range(mc_num // batch):
        counts = mask_counts(rng, length, batch)
        copies = masked_copies(rng, sequence, len(prefix), counts, mask_id)
        log_probs = target_log_probs(model, copies, sequence, len(prefix), cfg_scale, block_length)
        masked = copies[:, len(prefix):] == mask_id
        estimates.append(np.mean((log_probs * masked).sum(1) / (counts / length)))
    return float(np.mean(estimates))


def greedy_matches(model, prefix: list[int], target: list[int], cfg_scale: float = 0.0) -> bool:
    """Whether LLaDA's reference decoder (one token per step over the whole continuation) writes `target`."""
    if not prefix:
        raise LladaError("checking a greedy continuation needs a non-empty context (or check_greedy=false)")
    length = len(target)
    result = llada_jax.generate(model, np.array(prefix, np.int64), gen_length=length, block_length=length,
                                steps=length, cfg_scale=cfg_scale, policy="vanilla", loop="host")
    return result.output_ids.tolist() == list(target)


def block_greedy_answer(model, prefix: list[int], target: list[int], block_length: int) -> list[int]:
    """What greedy unmasking writes in `target`'s place under block diffusion's bound, as dllm's BD3LM check does
    it: `len(target)` steps, each committing the most confident masked position (a mask predicted as the mask
    token stays masked), every block reading the clean earlier blocks of prefix + target."""
    if not prefix:
        raise LladaError("checking a greedy continuation needs a non-empty context (or check_greedy=false)")
    clean = np.array(list(prefix) + list(target), np.int64)
    mask_id = model.config.mask_token_id
    canvas = clean.copy()
    canvas[len(prefix):] = mask_id
    for _ in target:
        logits = llada_jax.logits(model, canvas[None], block_length, context_ids=clean[None])[0].astype(np.float64)
        x0 = logits.argmax(-1)
        confidence = np.exp(true_log_probs(logits[None], x0)[0])
        best = int(np.argmax(np.where(canvas == mask_id, confidence, -np.inf)))
        canvas[best] = x0[best]
    return canvas[len(prefix):].tolist()
