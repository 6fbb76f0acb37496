"""Staged execution of a bundle: weights streamed layer by layer through a ring of device buffers
allocated once, sized to the device memory budget (numpy + iree.runtime only).

Each slot is one mapped device buffer (DEVICE_LOCAL | HOST_VISIBLE) reused for the whole run: filling
it is a copy into its mapping, done on the staging ring's copy thread while the previous layer runs.
The layer and head pieces take their tensors as separate arguments: zero-copy aliases into the slot.
"""

from __future__ import annotations

import numpy as np

from llada_jax import kv_state
from llada_jax.errors import LladaError
from llada_jax.packing import PackedLayout, head_chunks, head_layout, layer_layout
from llada_jax.readout import HEAD_PARTS, StepOutput, chunk_biases, combine_head_chunks
from llada_jax.staging import StagedWeights, StagingRing, StagingStats, kv_bytes, pack_weights, ring_slots
from llada_jax.weights_io import iter_tensors
from lowering.runtime import Bundle, IreeBackend, Session


class DeviceSlots:
    """`count` reusable device buffers of `elements` float32 each, allocated and mapped once. Each slot's
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

        self.tensors = {(slot, layout): [alias(view) for view in layout.views(self.views[slot]).values()]
                        for slot in range(count) for layout in layouts}

    def upload(self, slot: int, host: np.ndarray, layout: PackedLayout) -> list:
        """Copy a packed stage into a slot; its tensors, as the slot's device arrays."""
        np.copyto(self.views[slot][: host.size], host)
        return self.tensors[slot, layout]


class IreeStagedBackend(IreeBackend):
    """IreeBackend whose full and window steps run layer by layer with streamed weights."""

    def __init__(self, bundle: Bundle, session: Session, weights: StagedWeights, budget: int, readout, biases,
                 cfg_scale: float, batch: int, canvas_slots: int):
        super().__init__(bundle, session, readout, biases, cfg_scale)
        self.weights = weights
        ring = ring_slots(budget, weights, kv_bytes(self.config, batch, canvas_slots, 4))
        self.layouts = (layer_layout(self.config), head_layout(self.config))
        check_piece_layouts(bundle, *self.layouts)
        self.slots = DeviceSlots(session, ring, max(p.size for p in weights.stages), self.layouts)
        self.stats = StagingStats()
        self.ring = StagingRing(weights.stages, ring, self._upload, self.stats)
        # Each head chunk's slices of the token biases, uploaded once per generation.
        self._chunk_extras = [(self._extras[0], session.upload(part.logit_bias), session.upload(part.confidence_bias))
                              for part in chunk_biases(biases, *head_chunks(self.config))]

    def _staged(self, ids, positions, bias, layer_name: str, state, width: int) -> StepOutput:
        batch = ids.shape[0]
        x = self.session.upload(self.weights.embedding[np.asarray(ids)])
        keys, values, parts = [], [], []
        n_layers = self.config.n_layers

        def compute(stage: int, tensors: list) -> None:
            nonlocal x
            if stage < n_layers:
                extra = () if state is None else (state.keys, state.values, np.asarray(stage, np.int32))
                x, k, v = self._call(layer_name, *tensors, x, positions, bias, *extra)
                keys.append(k)
                values.append(v)
            else:
                outputs = self._call(f"head_b{batch}_w{width}", *tensors, x, *self._chunk_extras[stage - n_layers])
                parts.append(dict(zip(HEAD_PARTS, map(self.session.read, outputs))))

        self.ring.run(compute)
        stack = f"stack_b{batch}_w{width}"
        out = combine_head_chunks(parts, head_chunks(self.config)[1], self.config.embedding_size)
        return StepOutput(out, self._call(stack, *keys), self._call(stack, *values))

    def _upload(self, slot: int, stage: int) -> list:
        layout = self.layouts[0] if stage < self.config.n_layers else self.layouts[1]
        return self.slots.upload(slot, self.weights.stages[stage], layout)

    def full(self, tokens: np.ndarray, valid: np.ndarray) -> StepOutput:
        batch, slots = tokens.shape
        positions = np.broadcast_to(np.arange(slots, dtype=np.int32), tokens.shape).copy()
        bias = np.where(valid, 0.0, kv_state.HIDDEN).astype(np.float32)
        return self._staged(tokens, positions, bias, f"layer_full_b{batch}_s{slots}", None, slots)

    def window(self, state, visible, window_ids, window_pos, window_valid) -> StepOutput:
        batch, width = window_ids.shape
        bias = np.concatenate([kv_state.visible_bias(state, visible),
                               np.where(window_valid, 0.0, kv_state.HIDDEN).astype(np.float32)], axis=1)
        return self._staged(np.asarray(window_ids), np.asarray(window_pos, np.int32), bias,
                            f"layer_window_b{batch}_s{state.slots}_w{width}", state, width)


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
    """Pack the bundle's weights per stage on the host (float32), from its memory-mapped safetensors."""
    from safetensors import safe_open

    weight_map = {}
    for file in bundle.manifest["weights"]["files"]:
        path = bundle.path / file  # absolute paths (linked weights) stay absolute
        with safe_open(str(path), framework="np") as handle:
            weight_map.update({name: str(path) for name in handle.keys()})
    return pack_weights(iter_tensors(bundle.path, bundle.config, weight_map), bundle.config, np.dtype(np.float32))
