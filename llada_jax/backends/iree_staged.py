"""Staged execution of a bundle: weights streamed layer by layer through a ring of device buffers
allocated once, sized to the device memory budget (numpy + iree.runtime only).

Each ring buffer is one mapped device buffer (DEVICE_LOCAL | HOST_VISIBLE) reused for the whole run:
filling it is a copy into its mapping, done on the staging ring's copy thread while the previous layer
runs. The layer and head pieces take their tensors as separate arguments: zero-copy aliases into it.
"""

from __future__ import annotations

import numpy as np

from llada_jax.backends.iree import Bundle, IreeBackend, Session
from llada_jax.model.readout import HeadChunkReadout, Reads, StepOutput, chunk_biases
from llada_jax.staging.packing import PackedLayout, head_chunks, head_layout, layer_layout
from llada_jax.staging.swap import (
    StagedWeights,
    StagingRing,
    StagingStats,
    kv_bytes,
    pack_weights,
    ring_buffers,
    staged_full,
    staged_window,
)
from llada_jax.system.errors import LladaError
from llada_jax.weights.safetensors_file import SafetensorsFile
from llada_jax.weights.weights_io import iter_tensors
from lowering.bundle_format import StepSpec


class DeviceBuffers:
    """`count` reusable device buffers of `elements` float32 each, allocated and mapped once. Each buffer's
    tensors are aliased once per stage layout as zero-copy sub-buffers of its mapping, so a staged piece
    gets one argument per tensor without any per-step allocation."""

    def __init__(self, session: Session, count: int, elements: int, layouts: tuple[PackedLayout, ...]):
        rt = session._rt
        memory = int(rt.MemoryType.DEVICE_LOCAL | rt.MemoryType.HOST_VISIBLE)
        usage = int(rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING_PERSISTENT)
        allocator = session.device.allocator
        self.buffers = [allocator.allocate_buffer(memory_type=memory, allowed_usage=usage, allocation_size=elements * 4)
                        for _ in range(count)]
        self.mappings = [buffer.map() for buffer in self.buffers]
        self.views = [m.asarray((elements,), np.dtype(np.float32)) for m in self.mappings]

        def alias(view: np.ndarray):
            buffer = allocator.import_host_allocation(view, memory, int(rt.BufferUsage.DEFAULT))
            return rt.DeviceArray(session.device, rt.HalBufferView(buffer, view.shape, rt.HalElementType.FLOAT_32))

        self.tensors = {(index, layout): [alias(view) for view in layout.views(self.views[index]).values()]
                        for index in range(count) for layout in layouts}

    def upload(self, index: int, host: np.ndarray, layout: PackedLayout) -> list:
        """Copy a packed stage into buffer `index`; its tensors, as that buffer's device arrays."""
        np.copyto(self.views[index][: host.size], host)
        return self.tensors[index, layout]


class IreeStagedBackend(IreeBackend):
    """IreeBackend whose full and window steps run layer by layer with streamed weights
    (`staging.staged_forward` over this IREE device adapter)."""

    def __init__(self, bundle: Bundle, session: Session, weights: StagedWeights, budget: int, readout_spec, biases,
                 cfg_scale: float, batch: int, canvas_slots: int, side=None):
        super().__init__(bundle, session, readout_spec, biases, cfg_scale, side)
        self.weights = weights
        buffers = ring_buffers(budget, weights, kv_bytes(self.config, batch, canvas_slots, 4))
        self.layouts = (layer_layout(self.config), head_layout(self.config))
        check_piece_layouts(bundle, *self.layouts)
        self.buffers = DeviceBuffers(session, buffers, max(p.size for p in weights.stages), self.layouts)
        self.stats = StagingStats()
        self.ring = StagingRing(weights.stages, buffers, self._upload, self.stats)
        # Each head chunk's slices of the token biases, uploaded once per generation.
        self._chunk_extras = [(self._extras[0], session.upload(part.logit_bias), session.upload(part.confidence_bias))
                              for part in chunk_biases(biases, *head_chunks(self.config))]

    def _upload(self, buffer: int, stage: int) -> list:
        layout = self.layouts[0] if stage < self.config.n_layers else self.layouts[1]
        return self.buffers.upload(buffer, self.weights.stages[stage], layout)

    # The device adapter of `staging.staged_forward`.
    def embed(self, rows: np.ndarray):
        return self.session.upload(rows)

    def layer(self, tensors: list, x, positions, key_bias, state, layer: int):
        batch, width = positions.shape
        if state is None:
            return self._call(StepSpec("layer_full", batch, width).name, *tensors, x, positions, key_bias)
        name = StepSpec("layer_window", batch, state.slots, width).name
        return self._call(name, *tensors, x, positions, key_bias, state.keys, state.values, np.asarray(layer, np.int32))

    def head(self, tensors: list, x, chunk: int) -> HeadChunkReadout:
        batch, width = x.shape[:2]
        outputs = self._call(StepSpec("head", batch, 0, width).name, *tensors, x, *self._chunk_extras[chunk])
        return HeadChunkReadout(*map(self.session.read, outputs))

    def stack(self, per_layer: list):
        batch, width = per_layer[0].shape[:2]
        return self._call(StepSpec("stack", batch, 0, width).name, *per_layer)

    # The backend.
    def full(self, tokens: np.ndarray, valid: np.ndarray, reads: Reads | None = None) -> StepOutput:
        return staged_full(self, self.ring, self.weights, self.config, tokens, valid, reads)

    def window(self, state, visible, window_ids, window_pos, window_valid, reads: Reads | None = None) -> StepOutput:
        return staged_window(self, self.ring, self.weights, self.config, state, visible, window_ids, window_pos,
                             window_valid, reads)

    def staging_stats(self) -> dict:
        return self.stats.as_dict()


def check_piece_layouts(bundle: Bundle, layer: PackedLayout, head: PackedLayout) -> None:
    """Every staged piece of the bundle takes its weights in the shapes this runtime packs them in."""
    for step in bundle.manifest["steps"]:
        layout = {"layer_full": layer, "layer_window": layer, "head": head}.get(step["kind"])
        if layout is None:
            continue
        compiled = [tuple(tensor["shape"]) for tensor in step["inputs"][: len(layout.entries)]]
        if compiled != [shape for _, shape, _ in layout.entries]:
            raise LladaError(f"{bundle.path}: step {step['name']} was compiled for another staged weight layout "
                             f"(weights {compiled}); recompile the bundle")


def staged_weights(bundle: Bundle) -> StagedWeights:
    """Pack the bundle's weights per stage on the host (float32), from its safetensors files."""
    weight_map = {}
    for file in bundle.manifest["weights"]["files"]:
        path = bundle.path / file  # absolute paths (linked weights) stay absolute
        with SafetensorsFile(path) as handle:
            weight_map.update({name: str(path) for name in handle.entries})
    tensors = iter_tensors(bundle.path, bundle.config, weight_map, quantized={})
    return pack_weights(tensors, bundle.config, np.dtype(np.float32))
