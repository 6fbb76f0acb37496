"""What a step reads out per computed position. Plain data (no JAX), shared by every backend."""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import numpy as np

from llada_jax.model.arrays import Array
from llada_jax.model.shapes import bucket
from llada_jax.system.errors import LladaError

ReadoutKind = Literal["argmax", "logits"]


@dataclasses.dataclass(frozen=True)
class ReadoutSpec:
    """What a step reads out. kind: "argmax" (token + log-probability, cheap to read back) or "logits"
    (float32, full vocab). cfg: batch rows are (conditional, unconditional), combined into one row of
    guided logits."""

    kind: ReadoutKind = "argmax"
    cfg: bool = False


class Readout(NamedTuple):
    """What a step read out at its computed positions, rows `[B', W]`: the argmax token `x0` with its
    log-probability `logp` (an argmax readout), or `logits` `[B', W, E]` (a logits readout)."""

    x0: Array = None       # None where the readout's kind has none
    logp: Array = None
    logits: Array = None


class HeadChunkReadout(NamedTuple):
    """One vocabulary chunk's partial argmax readout (see `layered.partial_readout`), rows `[B', W]`."""

    x0: Array
    lmax: Array
    top: Array
    others: Array
    smax: Array
    ssum: Array


Reads = tuple  # the window columns (ascending, distinct) whose predictions a step returns; None: all


def read_width(count: int, rows: int) -> int:
    """The declared width the LM head runs in to read out `count` of a step's `rows`: the host loop's steps pad
    their reads to it (`head_rows_for`), the compiled loop branches over these widths (`LoopSpec.head_widths`)."""
    return bucket(count, rows)


def head_rows_for(reads: Reads | None, rows: int) -> np.ndarray:
    """The hidden rows `[R]` (int32) the LM head runs on for `reads` of a step's `rows`: `reads` padded to
    the declared width R = bucket(len(reads)) by repeating the last (every row when `reads` is None).
    A step returns the readout of the first len(reads) (`first_columns`)."""
    if reads is None:
        return np.arange(rows, dtype=np.int32)
    columns = np.asarray(reads, np.int32)
    if columns.size == 0 or columns.min() < 0 or columns.max() >= rows or np.any(np.diff(columns) <= 0):
        raise ValueError(f"read-out columns must be distinct, ascending and within the step's {rows} rows")
    padded = np.full(read_width(columns.size, rows), columns[-1], np.int32)
    padded[: columns.size] = columns
    return padded


def first_columns(readout: Readout, count: int) -> Readout:
    """The readout of its first `count` columns (the real part of a head run on padded rows)."""
    return Readout(*(None if value is None else value[:, :count] for value in readout))


def read_columns(readout: Readout, reads: Reads | None) -> Readout:
    """The readout at the columns `reads` only: what a backend that computed every column returns when a
    step asked for `reads`."""
    if reads is None:
        return readout
    return Readout(*(None if value is None else value[:, list(reads)] for value in readout))


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What every backend's step returns: the readout on the host, proposed K/V on the device."""

    readout: Readout  # numpy
    keys: Array       # proposed K [N, B, W, K, hd]
    values: Array     # proposed V [N, B, W, K, hd]


def check_finite(readout: Readout, positions: np.ndarray, valid: np.ndarray, step: int) -> None:
    """Refuse a step whose readout holds NaN (or +inf) at a computed position: garbage from here on.
    -inf is legitimate (a token biased away, or x0 left out of the confidence softmax). `positions`
    `[W]` are the canvas positions of the readout's columns, real where `valid`."""
    values = readout.logits if readout.logits is not None else readout.logp
    position = int(first_nonfinite(np, values, valid, positions, none=-1))
    if position >= 0:
        raise nonfinite_error(step, position)


def first_nonfinite(xp, values, valid, positions, none: int):
    """The canvas position of the first valid column of `values` `[B', W, ...]` (any row, any vocabulary entry)
    holding NaN or +inf, else `none`. One rule for both loops: `xp` is numpy on the host, jax.numpy in the
    compiled loop; column i is canvas position `positions[i]`, real where `valid[i]`."""
    bad = nonfinite(xp, values)
    bad = xp.any(bad.reshape(bad.shape[0], bad.shape[1], -1), axis=(0, 2)) & valid  # [W]
    return xp.where(xp.any(bad), positions[xp.argmax(bad)], none)


def nonfinite(xp, values):
    """Scores that break a step: NaN or +inf (-inf is legitimate: a token biased away). One test for both loops:
    `xp` is numpy on the host, jax.numpy in the compiled loop."""
    return xp.isnan(values) | xp.isposinf(values)


def nonfinite_error(step: int, position: int) -> LladaError:
    return LladaError(f"step {step + 1} produced a non-finite score (NaN/Inf) at canvas position {position}: the "
                      "model's weights or inputs hold non-finite values (--check-weights scans the weights at load)")


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


def chunk_biases(biases: TokenBiases, chunks: int, rows: int) -> list[TokenBiases]:
    """Per-chunk slices of the token biases for a head staged in `chunks` vocabulary slices of `rows`;
    padding rows past the vocabulary get a -inf logit bias (never predicted, no probability)."""
    logit = np.full(chunks * rows, -np.inf, np.float32)
    confidence = np.zeros(chunks * rows, np.float32)
    logit[: biases.logit_bias.size] = biases.logit_bias
    confidence[: biases.confidence_bias.size] = biases.confidence_bias
    return [TokenBiases(logit[c * rows: (c + 1) * rows], confidence[c * rows: (c + 1) * rows]) for c in range(chunks)]


def combine_head_chunks(parts: list, rows: int, vocab: int) -> Readout:
    """The readout of the whole head from its chunks' partial readouts (see `layered.partial_readout`):
    logits are concatenated; x0 is the first chunk-argmax with the highest logit (the global argmax,
    first on ties) and log p(x0) = -log1p(others), where others adds the winning chunk's own sum to
    every other chunk's whole sum rescaled to the winner's score."""
    if isinstance(parts[0], Readout):  # chunks of a logits readout
        return Readout(logits=np.concatenate([p.logits for p in parts], axis=-1)[..., :vocab])

    def stacked(name):
        return np.stack([np.asarray(getattr(p, name), np.float64) for p in parts])  # [C, B, W]

    winner = np.argmax(stacked("lmax"), axis=0)[None]
    top = np.take_along_axis(stacked("top"), winner, 0)[0]
    with np.errstate(over="ignore", invalid="ignore"):
        rest = np.nan_to_num(stacked("ssum") * np.exp(stacked("smax") - top), nan=0.0, posinf=np.inf)
        rest = np.where(np.arange(len(parts))[:, None, None] == winner, 0.0, rest).sum(0)
        logp = -np.log1p(np.take_along_axis(stacked("others"), winner, 0)[0] + rest)
    x0 = np.take_along_axis(stacked("x0"), winner, 0)[0].astype(np.int64) + winner[0] * rows
    logp = np.where(np.isneginf(top), -np.inf, logp).astype(np.float32)
    tiny = np.finfo(np.float32).tiny  # subnormals flushed to 0, as `steps.argmax_logprob` does
    return Readout(x0=x0.astype(np.int32), logp=np.where(logp > -tiny, np.float32(0.0), logp))
