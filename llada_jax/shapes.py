"""The declared set of static shapes. Every canvas and window is padded up to one of these lengths
(padding is masked out of attention, never sliced), so each shape compiles once per process."""

from __future__ import annotations

from llada_jax.errors import LladaError

LENGTH_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def bucket(length: int, limit: int | None = None) -> int:
    """The smallest declared length >= `length`; `limit` (the model's max length) caps it."""
    if length <= 0:
        raise LladaError(f"cannot bucket a length of {length}")
    if limit is not None and length > limit:
        raise LladaError(f"length {length} exceeds the limit {limit}")
    for size in LENGTH_BUCKETS:
        if size >= length:
            return size if limit is None else min(size, limit)
    if limit is not None:
        return limit
    raise LladaError(f"length {length} is beyond the largest shape bucket {LENGTH_BUCKETS[-1]}")
