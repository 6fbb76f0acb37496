"""The declared set of static shapes. Every canvas and window is padded up to one of these lengths
(padding is masked out of attention, never sliced), so each shape compiles once per process; and the
shape of the KV state, built here for every backend, the exporter and the memory budget."""

from __future__ import annotations

from llada_jax.system.errors import LladaError

SMALL_BUCKETS = (8, 16, 32)   # below these the step is host overhead, not compute: few shapes, few compiles
GRANULE = 32                  # the finest step above them (a multiple of every SIMD width and IREE tile)
LARGEST = 32768


def _length_buckets() -> tuple[int, ...]:
    """8, 16, 32, then multiples of max(32, P/8) between each power of two P and 2P: padding wastes at most
    1/8 of a step from 256 positions on (at most 32 positions below), with 8 shapes per doubling."""
    sizes: list[int] = list(SMALL_BUCKETS)
    while sizes[-1] < LARGEST:
        power = 1 << (sizes[-1].bit_length() - 1)  # the largest power of two <= the last size
        sizes.append(sizes[-1] + max(GRANULE, power // 8))
    return tuple(sizes)


LENGTH_BUCKETS = _length_buckets()


def widths_within(rows: int) -> list[int]:
    """The declared widths of at most `rows` positions: every bucket below it, and `rows` itself."""
    return sorted({size for size in LENGTH_BUCKETS if size < rows} | {rows})


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


def kv_shape(config, batch: int, slots: int) -> tuple[int, int, int, int, int]:
    """K (or V) of every layer for `slots` positions: `[N, B, S, K, hd]`."""
    return (config.n_layers, batch, slots, config.n_kv_heads, config.head_dim)
