"""Swap-optimized execution: run a model whose weights exceed the device memory budget.

Weights are packed once, at load time, into one contiguous aligned host buffer per stage (each
decoder layer; each vocabulary chunk of the head, with the final norm, about a layer's size), straight
from the checkpoint as it is read; the embedding stays on the host (a row gather). A forward pass
streams the stages through two device buffers: while one stage computes, a background thread copies the
next into the other buffer. Buffers the budget allows beyond those two pin the largest stages, copied once
per generation, so a bigger budget copies fewer bytes per pass. The KV state stays resident; it must
fit next to at least one buffer, or the budget is refused with the minimum it would need.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Callable, Protocol

import numpy as np
from numpy.typing import DTypeLike

from llada_jax.kernels.schemes import Kernels, scheme_for
from llada_jax.model.arrays import Array
from llada_jax.model.config import LLaDAConfig
from llada_jax.model.kv_state import KVState, visible_bias, window_key_bias, with_context_bias
from llada_jax.model.params import block_from_stage, stage_key, tensor_places
from llada_jax.model.readout import HeadChunkReadout, Reads, StepOutput, combine_head_chunks, read_columns
from llada_jax.model.shapes import kv_shape
from llada_jax.quant.quantize import Activations, HostQuantized, QuantScheme, dequantize
from llada_jax.staging.packing import (
    PackedLayout,
    head_chunk_tensors,
    head_chunks,
    head_layout,
    layer_layout,
    quantized_layout,
)
from llada_jax.system.errors import LladaError

# A stage's quantized matrices, as the jitted pieces take them (static): (name, bits, activations, our kernel
# or "") each.
Quantization = tuple[tuple[str, int, str, str], ...]


@dataclasses.dataclass(frozen=True)
class StagedWeights:
    embedding: np.ndarray | HostQuantized  # [E, D] host, gathered on the host
    layers: tuple[np.ndarray, ...]
    head: tuple[np.ndarray, ...]  # chunks: final norm + a vocabulary slice of the LM head each
    dtype: DTypeLike
    layouts: tuple                # per stage: its PackedLayout, or ByteLayout when quantized
    quantization: tuple[Quantization, ...]  # per stage ((): none)

    @property
    def buffer_bytes(self) -> int:
        return max(p.nbytes for p in self.stages)

    @property
    def stages(self) -> tuple[np.ndarray, ...]:
        return (*self.layers, *self.head)

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        """Embedding rows of `ids` in the compute dtype (a quantized table dequantizes only these rows)."""
        if not isinstance(self.embedding, HostQuantized):
            return self.embedding[ids]
        table, flat = self.embedding, ids.reshape(-1)
        rows = dequantize(table.row_values(flat), table.scale[flat])
        return rows.reshape(*ids.shape, rows.shape[-1]).astype(self.dtype)


def pack_weights(tensors, config: LLaDAConfig, dtype, activations: Activations = "float",
                 kernels: Kernels = "compiler", stack_experts: bool = False) -> StagedWeights:
    """Pack every stage from (HF name, host array or HostQuantized) pairs read one at a time; a stage is
    packed as soon as its last tensor arrives, so at most a few stages are ever held unpacked. `stack_experts`
    (our kernels take every expert matrix, `llada_jax.model.moe.kernels_take_experts`): each MoE matrix kind's
    experts packed back to back as one stack `[E, ...]`, which the layer runs as one routed call."""
    n = config.n_layers
    places = tensor_places(config)
    stage_of = {name: (n, place[0]) if len(place) == 1 else (place[1], stage_key(place))
                for name, place in places.items()}
    pending: dict[int, dict] = {}
    packed: dict[int, tuple] = {}
    embedding = None
    for name, array in tensors:
        if places[name] == ("wte",):
            embedding = array if isinstance(array, HostQuantized) else np.asarray(array, dtype)
            continue
        stage, short = stage_of[name]
        pending.setdefault(stage, {})[short] = array
        if stage < n and len(pending[stage]) == len(layer_layout(config, stage).entries):
            layer = block_from_stage(pending.pop(stage)) if stack_experts else pending.pop(stage)
            packed[stage] = _pack_stage(layer, layer_layout(config, stage, stack_experts), dtype, activations, kernels)
    head = pending.pop(n)
    chunks = [_pack_stage(chunk, head_layout(config), dtype, activations, kernels)
              for chunk in head_chunk_tensors(head["ln_f"], head["lm_head"], config)]
    stages = [packed[i] for i in range(n)] + chunks
    assert embedding is not None, "the checkpoint's names were checked at load: it has an embedding"
    return StagedWeights(embedding, tuple(s[0] for s in stages[:n]), tuple(s[0] for s in chunks), dtype,
                         tuple(s[1] for s in stages), tuple(s[2] for s in stages))


def _pack_stage(tensors: dict, layout: PackedLayout, dtype, activations: Activations,
                kernels: Kernels = "compiler") -> tuple:
    """(packed buffer, its layout, its Quantization) of one stage; quantized matrices keep their integers. A list
    (a stack's experts) is packed as one tensor `[E, ...]`."""
    firsts = {name: t[0] if isinstance(t, list) else t for name, t in tensors.items()}
    schemes = {name: t.scheme for name, t in firsts.items() if isinstance(t, HostQuantized)}
    if not schemes:
        return layout.pack(tensors, dtype), layout, ()
    shapes = {name: shape for name, shape, _ in layout.entries}
    modes = tuple(_mode(name, scheme, shapes[name], activations, kernels) for name, scheme in schemes.items())
    quantized = quantized_layout(shapes, schemes, dtype, {name: firsts[name].scale.dtype for name in schemes},
                                 frozenset(name for name, *_, kernel in modes if kernel))
    parts = {}
    for name, tensor in tensors.items():
        if name in schemes:
            parts[f"{name}.values"], parts[f"{name}.scale"] = _stored(tensor)
        else:
            parts[name] = tensor
    return quantized.pack(parts), quantized, modes


def _stored(matrix) -> tuple[np.ndarray, np.ndarray]:
    """A quantized matrix's (bytes as stored, scales); a list of them (a stack's experts) stacked."""
    if isinstance(matrix, list):
        return np.stack([m.stored_bytes() for m in matrix]), np.stack([m.scale for m in matrix])
    return matrix.stored_bytes(), matrix.scale


def _mode(name: str, scheme: QuantScheme, shape: tuple, activations: Activations, kernels: Kernels) -> tuple:
    """(name, bits, activations, kernel) of one staged matrix: our kernel where one takes it (as resident)."""
    columns = shape[-1]
    kernel = scheme_for(scheme.bits, activations, columns, scheme.group_size or columns) if kernels == "own" else None
    return name, scheme.bits, activations if kernel else scheme.matmul_activations(activations), kernel or ""


def kv_bytes(config: LLaDAConfig, batch: int, slots: int, itemsize: int) -> int:
    return 2 * math.prod(kv_shape(config, batch, slots)) * itemsize


def ring_buffers(budget: int, weights: StagedWeights, kv: int) -> int:
    """How many staging buffers fit next to the KV state; at least one, else a clear error."""
    buffers = (budget - kv) // weights.buffer_bytes
    if buffers < 1:
        largest = "an LM head chunk" if weights.head[0].nbytes == weights.buffer_bytes else "one decoder layer"
        raise LladaError(f"device memory budget {budget} bytes is too small: the largest staged piece ({largest}, "
                         f"{weights.buffer_bytes} bytes) plus the KV state ({kv} bytes) need at least "
                         f"{weights.buffer_bytes + kv} bytes")
    return int(min(buffers, len(weights.stages)))


STREAM_BUFFERS = 2  # buffers that stream: one stage computes while the next is copied in


@dataclasses.dataclass
class StagingStats:
    bytes_staged: int = 0
    copy_seconds: float = 0.0     # spent by the copy thread
    compute_seconds: float = 0.0  # spent computing stages
    wait_seconds: float = 0.0     # compute stalled waiting for a copy
    pinned_stages: int = 0        # stages held in their own buffer, copied once per generation (or held)

    @property
    def hidden_fraction(self) -> float:
        """Share of copy time overlapped by compute."""
        if self.copy_seconds == 0:
            return 1.0
        return max(0.0, 1.0 - self.wait_seconds / self.copy_seconds)

    def as_dict(self) -> dict:
        return {"bytes_staged": self.bytes_staged, "copy_seconds": self.copy_seconds,
                "compute_seconds": self.compute_seconds, "hidden_fraction": self.hidden_fraction,
                "pinned_stages": self.pinned_stages}


class StagingRing:
    """N reusable device buffers holding a fixed sequence of host stages, copies overlapped with compute.

    `upload(buffer, stage)` copies a stage into a buffer and returns what compute reads. The first
    min(N, STREAM_BUFFERS) buffers stream: the j-th streamed stage lives in buffer j mod STREAM_BUFFERS and is
    copied only after streamed stage j - STREAM_BUFFERS finished computing. Every further buffer pins one
    stage (largest first): copied on first use and kept for the ring's life, so a budget above the
    minimum cuts the bytes copied per pass instead of prefetching deeper than overlap needs. `held`: stages
    already on the device (stage -> what compute reads), never copied.
    """

    def __init__(self, stages: tuple[np.ndarray, ...], buffers: int, upload: Callable, stats: StagingStats,
                 held: dict | None = None):
        self.stages, self.upload, self.stats = stages, upload, stats
        streaming = min(buffers, STREAM_BUFFERS) if buffers < len(stages) else 0
        by_size = sorted(range(len(stages)), key=lambda i: (-stages[i].nbytes, i))
        pinned = sorted(by_size[: buffers - streaming])
        self.pinned_buffer = {stage: streaming + k for k, stage in enumerate(pinned)}
        streamed = (i for i in range(len(stages)) if i not in self.pinned_buffer)
        self.streamed = {stage: j for j, stage in enumerate(streamed)}
        self.streaming = streaming
        self.pinned: dict[int, object] = dict(held or {})  # stage -> its loaded buffer, once copied (or held)
        stats.pinned_stages = len(self.pinned_buffer)

    def _buffer(self, stage: int) -> int:
        if stage in self.pinned_buffer:
            return self.pinned_buffer[stage]
        return self.streamed[stage] % self.streaming

    def run(self, compute: Callable[[int, object], None]) -> None:
        """One pass over every stage in order: compute(stage, loaded buffer)."""
        count = len(self.stages)
        to_copy = [i for i in range(count) if i not in self.pinned]
        ready = {stage: threading.Event() for stage in to_copy}
        freed = [threading.Event() for _ in self.streamed]  # streamed stage j finished computing
        loaded: dict[int, object] = dict(self.pinned)
        failure: list = []
        stop = threading.Event()

        def copier():
            for stage in to_copy:
                j = self.streamed.get(stage, -1)
                if j >= self.streaming:
                    freed[j - self.streaming].wait()
                if stop.is_set():
                    return
                try:
                    started = time.perf_counter()
                    loaded[stage] = self.upload(self._buffer(stage), stage)
                    self.stats.copy_seconds += time.perf_counter() - started
                    self.stats.bytes_staged += self.stages[stage].nbytes
                except BaseException as err:  # surfaced in the computing thread
                    failure.append(err)
                ready[stage].set()

        thread = threading.Thread(target=copier, daemon=True)
        thread.start()
        try:
            for stage in range(count):
                if stage in ready:
                    started = time.perf_counter()
                    ready[stage].wait()
                    self.stats.wait_seconds += time.perf_counter() - started
                if failure:
                    raise failure[0]
                started = time.perf_counter()
                compute(stage, loaded[stage])
                self.stats.compute_seconds += time.perf_counter() - started
                if stage in self.pinned_buffer:
                    self.pinned[stage] = loaded[stage]
                else:
                    freed[self.streamed[stage]].set()
        finally:
            stop.set()
            for event in freed:
                event.set()  # a copier waiting for a buffer (after a failure) wakes up and stops
            thread.join()


class StagedDevice(Protocol):
    """What a staged forward needs of a device (XLA arrays or IREE buffers); `tensors` are one stage's
    weights as `upload` put them in a ring buffer."""

    def embed(self, rows: np.ndarray) -> Array:
        """Embedding rows `[B, W, D]` gathered on the host, to the device."""
        ...

    def layer(self, tensors, x, positions: np.ndarray, key_bias: np.ndarray, state,
              layer: int) -> tuple[Array, Array, Array]:
        """One decoder layer: (x, k, v); `state` None for a full step, else the KV state's cached K/V."""
        ...

    def head(self, tensors, x, chunk: int) -> HeadChunkReadout | Array:
        """One head chunk's readout on the host: a `HeadChunkReadout` (argmax), or its logits."""
        ...

    def stack(self, per_layer: list) -> Array:
        """Per-layer proposed K (or V) stacked into `[N, B, W, K, hd]`."""
        ...


def staged_forward(device: StagedDevice, ring: StagingRing, weights: StagedWeights, config: LLaDAConfig,
                   ids: np.ndarray, positions: np.ndarray, key_bias: np.ndarray, state,
                   reads: Reads | None = None) -> StepOutput:
    """The forward pass stage by stage through the ring: embedding on the host, each layer, then each
    head chunk, whose partial readouts merge on the host into the readout of the whole head (cut to
    `reads` there: staged head chunks are compiled for the whole step width)."""
    x = device.embed(weights.embed_rows(np.asarray(ids)))
    keys, values, parts = [], [], []

    def compute(stage: int, tensors) -> None:
        nonlocal x
        if stage < config.n_layers:
            x, k, v = device.layer(tensors, x, positions, key_bias, state, stage)
            keys.append(k)
            values.append(v)
        else:
            parts.append(device.head(tensors, x, stage - config.n_layers))

    ring.run(compute)
    readout = combine_head_chunks(parts, head_chunks(config)[1], config.embedding_size)
    return StepOutput(read_columns(readout, reads), device.stack(keys), device.stack(values))


def staged_full(device: StagedDevice, ring: StagingRing, weights: StagedWeights, config: LLaDAConfig,
                tokens: np.ndarray, valid: np.ndarray, reads: Reads | None = None) -> StepOutput:
    """A full step `[B, S]` through the ring (rotary positions as `llada_jax.model.steps.full_step` gives them)."""
    positions = np.maximum(np.cumsum(valid, axis=1, dtype=np.int32) - 1, 0)
    bias = window_key_bias(np.asarray(valid))
    return staged_forward(device, ring, weights, config, tokens, positions, bias, None, reads)


def staged_window(device: StagedDevice, ring: StagingRing, weights: StagedWeights, config: LLaDAConfig,
                  state: KVState, visible, window_ids, window_pos, window_valid,
                  reads: Reads | None = None, blocks=None) -> StepOutput:
    """A window step `[B, W]` against the KV state through the ring (keys: cached slots, then the window; with
    `blocks`, per query: `kv_state.window_key_bias`)."""
    bias = with_context_bias(visible_bias(state, visible), window_key_bias(np.asarray(window_valid), blocks))
    return staged_forward(device, ring, weights, config, np.asarray(window_ids), np.asarray(window_pos, np.int32),
                          bias, state, reads)

