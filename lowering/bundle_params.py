"""The params pytree a bundle's step computes with, from its named parameters as stored
(`lowering.bundle_weights`): float tensors cast to the compute dtype, each quantized module a `QuantizedWeight`
(offset values signed again; no hoisting barrier, which iree-compile could not schedule at LLaDA-8B's size). A
streamed layout's layers and LM head are `Stage`s, which the forward fetches (`llada_jax.model.staged`)."""

from __future__ import annotations

import jax.numpy as jnp

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.params import block_from_stage, hf_shapes, hf_to_params, stage_key, tensor_places
from llada_jax.model.staged import Stage
from llada_jax.quant.qlinear import QuantizedWeight, offset_values, row_block_for
from llada_jax.quant.quantize import Activations
from lowering.bundle_weights import WeightLayout
from lowering.stage_ring import ring_plan, stage_of


def params_of(weights, layout: WeightLayout, config: LLaDAConfig, compute_dtype, activations: Activations) -> dict:
    """The params pytree from `weights`, one array per `layout.parameters` entry."""
    stored = {p.name: w for p, w in zip(layout.parameters, weights)}
    if not layout.streamed:
        return hf_to_params(converted(stored, layout, config, compute_dtype, activations), config)
    stages = [[piece.key for piece in stage] for stage in ring_plan(layout, config).stages]  # the slots' order
    resident = converted({p.name: stored[p.name] for p in layout.parameters if stage_of(p, config) is None},
                         layout, config, compute_dtype, activations)
    places = tensor_places(config)

    def staged(index: int) -> Stage:
        def build(arrays):
            tensors = converted(dict(zip(stages[index], arrays)), layout, config, compute_dtype, activations)
            if index == config.n_layers:
                return next(iter(tensors.values()))
            return block_from_stage({stage_key(places[name]): tensor for name, tensor in tensors.items()})
        return Stage(index, tuple(stored[n] for n in stages[index]), build)

    return {"wte": resident[_named(places, "wte")], "ln_f": resident[_named(places, "ln_f")],
            "blocks": [staged(i) for i in range(config.n_layers)], "lm_head": staged(config.n_layers)}


def _named(places, part: str) -> str:
    return next(name for name, place in places.items() if place == (part,))


def converted(stored: dict, layout: WeightLayout, config: LLaDAConfig, compute_dtype, activations: Activations) -> dict:
    """HF name -> tensor as the step computes with it, for each module whose stored tensors are in `stored`."""
    tensors = {}
    for name in hf_shapes(config):
        module = name[: -len(".weight")]
        if module not in layout.quantized:
            if name in stored:
                tensors[name] = stored[name].astype(compute_dtype)
            continue
        if module + ".weight_packed" not in stored:
            continue
        bits = layout.quantized[module].bits
        if module in layout.kernels:  # our kernel reads the bytes (declared i8) and scales as stored
            tensors[name] = QuantizedWeight(stored[module + ".weight_packed"], stored[module + ".weight_scale"],
                                            activations, hoist_barrier=False, offset=1 << (bits - 1),
                                            nibbles=bits == 4, kernel=layout.kernels[module])
            continue
        scale = stored[module + ".weight_scale"].astype(jnp.float32)
        activation = layout.quantized[module].matmul_activations(activations)
        packed = stored[module + ".weight_packed"]
        values, offset = (packed, 0) if layout.signed else offset_values(packed, bits, activation)
        tensors[name] = QuantizedWeight(values, scale, activation, row_block_for(values.shape), hoist_barrier=False,
                                        offset=offset)
    return tensors
