"""Weights streamed inside a compiled program (IREE bundles under a device memory budget, `lowering.stage_ring`).

A stage is one decoder layer's stored tensors, or a chunk of the LM head's rows (or the embedding's). In the params
pytree such a layer is a `Stage` rather than arrays, and such a head or embedding a tuple of them; the forward
calls `fetch` where it needs one, with the activations that enter it.
`fetch` emits one custom call, `llada_stage`, on those activations and the stage's stored tensors, returning
both: the bundle builder replaces it with a read of the stage from the weights file into a ring of device
buffers, ordered after those activations. XLA never runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

TARGET = "llada_stage"


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Stage:
    """A pytree whose leaves are the stored tensors (so it passes through `jax.jit` as params do)."""

    index: int                      # 0 .. n_layers - 1 for the layers, n_layers for the LM head
    stored: tuple                   # the stage's tensors as the weights file stores them
    build: Callable[[tuple], Any]   # stored tensors -> the layer's block dict, or the head, as params holds it

    def tree_flatten(self):
        return self.stored, (self.index, self.build)

    @classmethod
    def tree_unflatten(cls, aux, stored):
        return cls(aux[0], tuple(stored), aux[1])


def fetch(part: Any, x: jax.Array) -> tuple[Any, jax.Array]:
    """(part, x): a `Stage` read in after `x` and built; anything else, as it is."""
    if not isinstance(part, Stage):
        return part, x
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, *part.stored)]
    out = jax.ffi.ffi_call(TARGET, shapes, has_side_effect=True)(x, *part.stored, stage=np.int64(part.index))
    return part.build(tuple(out[1:])), out[0]


def fetch_each(parts: tuple[Stage, ...], x: jax.Array, compute: Callable[[Any, jax.Array, int], jax.Array]) -> list:
    """`compute(part, x, index)` for each part (an LM head's or an embedding's chunks), each fetched after the
    result before it: the read two chunks on, into the same buffer, waits for it."""
    results: list = []
    for index, part in enumerate(parts):
        built, entered = fetch(part, results[-1] if results else x)
        if results:
            results[-1] = entered
        else:
            x = entered
        results.append(compute(built, x, index))
    return results
