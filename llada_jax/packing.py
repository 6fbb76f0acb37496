"""Packed stage layout (no JAX): a stage's tensors (one layer's nine, or ln_f + lm_head) flattened one
after another, each starting at a multiple of ALIGN elements, in one contiguous aligned buffer.
`views` slices it back, without copies, into the tensors a staged piece takes as arguments."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from llada_jax.config import LLaDAConfig
from llada_jax.params import BLOCK_TENSORS, block_shapes

ALIGN = 16  # elements: every tensor of a packed stage starts on a 64-byte boundary (float32)
# Head chunks hold a multiple of this many vocabulary rows: IREE's llvm-cpu code for a 10667-row chunk
# ran ~10x slower per row than for 32000 rows (measured, 256 positions x d_model 1024).
CHUNK_ROWS = 128


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each tensor of a stage sits in its packed buffer (hashable: a static jit argument)."""

    entries: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, offset in elements)
    size: int                                               # elements, padded to ALIGN

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]]) -> "PackedLayout":
        entries, offset = [], 0
        for name, shape in shapes.items():
            entries.append((name, tuple(shape), offset))
            offset += -(-int(np.prod(shape)) // ALIGN) * ALIGN
        return cls(tuple(entries), offset)

    def pack(self, tensors: dict[str, np.ndarray], dtype) -> np.ndarray:
        """One contiguous, 64-byte aligned host buffer holding every tensor of the stage."""
        raw = np.zeros(self.size * np.dtype(dtype).itemsize + 64, np.uint8)
        start = (-raw.ctypes.data) % 64
        packed = raw[start: start + self.size * np.dtype(dtype).itemsize].view(dtype)
        for name, shape, offset in self.entries:
            packed[offset: offset + int(np.prod(shape))] = np.asarray(tensors[name], dtype).reshape(-1)
        return packed

    def views(self, packed: np.ndarray) -> dict[str, np.ndarray]:
        """The stage's tensors as views into its packed buffer (no copies), in layout order."""
        return {name: packed[offset: offset + int(np.prod(shape))].reshape(shape)
                for name, shape, offset in self.entries}


@functools.cache
def layer_layout(config: LLaDAConfig) -> PackedLayout:
    return PackedLayout.of({name: block_shapes(config)[name] for name in BLOCK_TENSORS})


@functools.cache
def head_chunks(config: LLaDAConfig) -> tuple[int, int]:
    """(chunks, rows): the LM head is staged in vocabulary slices of `rows` rows, as few as keep each
    about a decoder layer's size (LLaDA-8B's 126464-token head is 2.4 layers, and the largest stage
    sets the size of every staging slot)."""
    vocab = config.embedding_size
    wanted = max(1, -(-vocab * config.d_model // layer_layout(config).size))
    rows = -(-vocab // wanted // CHUNK_ROWS) * CHUNK_ROWS
    return -(-vocab // rows), rows  # no chunk left empty


@functools.cache
def head_layout(config: LLaDAConfig) -> PackedLayout:
    """One head chunk: the final norm and `rows` rows of the LM head (the last chunk zero-padded)."""
    return PackedLayout.of({"ln_f": (config.d_model,), "lm_head": (head_chunks(config)[1], config.d_model)})


def head_chunk_tensors(ln_f: np.ndarray, lm_head: np.ndarray, config: LLaDAConfig) -> list[dict]:
    """The head's tensors cut into its chunks (row slices, no copies), the last padded with zero rows."""
    chunks, rows = head_chunks(config)
    out = []
    for c in range(chunks):
        part = lm_head[c * rows: (c + 1) * rows]
        if part.shape[0] < rows:
            part = np.concatenate([np.asarray(part), np.zeros((rows - part.shape[0], part.shape[1]), part.dtype)])
        out.append({"ln_f": ln_f, "lm_head": part})
    return out


