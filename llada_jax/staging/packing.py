"""Packed stage layout (no JAX): a stage's tensors (one layer's, or ln_f + lm_head) flattened one
after another, each starting at a multiple of ALIGN elements, in one contiguous aligned buffer.
`views` slices it back, without copies, into the tensors a staged piece takes as arguments.

A quantized stage mixes dtypes (integer bytes and float scales), so its `ByteLayout` places each
tensor at a 64-byte aligned byte offset of one uint8 buffer; a quantized matrix `<name>` is stored as
`<name>.values` (its compressed-tensors packed bytes: `[O, I * bits / 8]` uint8, values offset by
2**(bits-1), see `quantize.pack_int32`) and `<name>.scale` (`[O, G]`, in the dtype the checkpoint stores)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numpy.typing import DTypeLike

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.params import layer_stage_shapes
from llada_jax.quant.quantize import HostQuantized, packed_words

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
        packed = _aligned_bytes(self.size * np.dtype(dtype).itemsize).view(dtype)
        for name, shape, offset in self.entries:
            packed[offset: offset + int(np.prod(shape))] = np.asarray(tensors[name], dtype).reshape(-1)
        return packed

    def views(self, packed: np.ndarray) -> dict[str, np.ndarray]:
        """The stage's tensors as views into its packed buffer (no copies), in layout order."""
        return {name: packed[offset: offset + int(np.prod(shape))].reshape(shape)
                for name, shape, offset in self.entries}


def _aligned_bytes(size: int) -> np.ndarray:
    raw = np.zeros(size + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start: start + size]


@dataclasses.dataclass(frozen=True)
class ByteLayout:
    """Where each tensor of a mixed-dtype stage sits in its packed uint8 buffer."""

    entries: tuple[tuple[str, tuple[int, ...], np.dtype, int], ...]  # (name, shape, dtype, byte offset)
    size: int                                                          # bytes, padded to 64

    @classmethod
    def of(cls, specs: dict[str, tuple[tuple[int, ...], DTypeLike]]) -> "ByteLayout":
        entries, offset = [], 0
        for name, (shape, dtype) in specs.items():
            entries.append((name, tuple(shape), np.dtype(dtype), offset))
            offset += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 64) * 64
        return cls(tuple(entries), offset)

    def pack(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """One 64-byte aligned uint8 buffer holding every tensor in its own dtype."""
        packed = _aligned_bytes(self.size)
        for name, view in self.views(packed).items():
            view[...] = np.asarray(tensors[name]).reshape(view.shape).astype(view.dtype, copy=False)
        return packed

    def views(self, packed: np.ndarray) -> dict[str, np.ndarray]:
        return {name: packed[offset: offset + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
                for name, shape, dtype, offset in self.entries}


def quantized_layout(shapes: dict[str, tuple[int, ...]], schemes: dict, float_dtype,
                     scale_dtypes: dict[str, DTypeLike], signed_bytes: frozenset[str] = frozenset()) -> ByteLayout:
    """The byte layout of a stage whose matrices named in `schemes` (name -> QuantScheme) are quantized, their
    scales held in `scale_dtypes` (name -> the stored dtype); the bytes of those in `signed_bytes` viewed as int8,
    as our kernels take them (a uint8 view made XLA copy a whole stack of experts to reinterpret it)."""
    specs = {}
    for name, shape in shapes.items():
        scheme = schemes.get(name)
        if scheme is None:
            specs[name] = (shape, float_dtype)
            continue
        *rows, columns = shape  # a stack of experts: [E, O, I]
        byte = np.int8 if name in signed_bytes else np.uint8
        specs[f"{name}.values"] = ((*rows, packed_words(columns, scheme.bits) * 4), byte)
        specs[f"{name}.scale"] = ((*rows, scheme.groups(columns)), scale_dtypes[name])
    return ByteLayout.of(specs)


@functools.cache
def layer_layout(config: LLaDAConfig, layer: int = 0, stacked: bool = False) -> PackedLayout:
    """Decoder layer `layer`'s tensors (a sparse MoE: each expert's matrices as their own entries, or with
    `stacked` each matrix kind's experts one stack)."""
    return PackedLayout.of(layer_stage_shapes(config, layer, stacked))


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


def head_chunk_tensors(ln_f: np.ndarray, lm_head, config: LLaDAConfig) -> list[dict]:
    """The head's tensors cut into its chunks (row slices, no copies), the last padded with zero rows
    (a quantized head: its integers and scales alike)."""
    chunks, rows = head_chunks(config)
    return [{"ln_f": ln_f, "lm_head": _rows(lm_head, c * rows, rows)} for c in range(chunks)]


def _rows(matrix, start: int, rows: int):
    if isinstance(matrix, HostQuantized):
        return matrix.rows(start, rows)
    part = matrix[start: start + rows]
    if part.shape[0] < rows:
        part = np.concatenate([np.asarray(part), np.zeros((rows - part.shape[0], *part.shape[1:]), part.dtype)])
    return part


