"""The params pytree a bundle's step computes with, from its named parameters as stored
(`lowering.bundle_weights`): float tensors cast to the compute dtype, each quantized module a `QuantizedWeight`
(offset values signed again; no hoisting barrier, which iree-compile could not schedule at LLaDA-8B's size). A
streamed layout's layers are `Stage`s, and its LM head (and a streamed embedding) a tuple of them (chunks of rows),
which the forward fetches (`llada_jax.model.staged`); a streamed MoE layer's experts come stacked, each matrix kind
one array `[E, ...]` (`lowering.stage_ring.Piece`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.moe import stacked
from llada_jax.model.params import hf_shapes, hf_to_params, tensor_places
from llada_jax.model.staged import Stage
from llada_jax.quant.qlinear import QuantizedWeight, offset_values, row_block_for
from llada_jax.quant.quantize import Activations
from lowering.bundle_weights import WeightLayout
from lowering.stage_ring import group_of, ring_plan


def params_of(weights, layout: WeightLayout, config: LLaDAConfig, compute_dtype, activations: Activations) -> dict:
    """The params pytree from `weights`, one array per `layout.parameters` entry."""
    stored = {p.name: w for p, w in zip(layout.parameters, weights)}
    if not layout.streamed:
        return _resident(stored, layout, config, compute_dtype, activations)
    plan = ring_plan(layout, config)
    resident = converted({p.name: stored[p.name] for p in layout.parameters if group_of(p, layout, config) is None},
                         layout, config, compute_dtype, activations)
    places = tensor_places(config)

    def staged(index: int) -> Stage:
        pieces = plan.stages[index]
        firsts = [piece.keys[0] for piece in pieces]  # a stack's tensors convert as its first expert's would

        def build(arrays):
            tensors = converted(dict(zip(firsts, arrays)), layout, config, compute_dtype, activations)
            if index >= config.n_layers:
                return next(iter(tensors.values()))
            return {places[name][2]: tensor for name, tensor in tensors.items()}  # an expert's key: its stack's
        if index < config.n_layers:
            return Stage(index, tuple(_stacked([stored[key] for key in piece.keys]) for piece in pieces), build)
        first, rows = plan.chunks[index - config.n_layers]
        return Stage(index, tuple(stored[key][first:first + rows] for key in firsts), build)

    wte = tuple(staged(i) for i in plan.embedding) or resident[_named(places, "wte")]
    return {"wte": wte, "ln_f": resident[_named(places, "ln_f")], "blocks": [staged(i) for i in range(config.n_layers)],
            "lm_head": tuple(staged(i) for i in plan.head)}


def _resident(stored: dict, layout: WeightLayout, config: LLaDAConfig, compute_dtype, activations: Activations):
    """The params of resident weights; a stack (`WeightLayout.stacks`) converts as its first expert's tensor
    would and is placed whole."""
    as_first = {name: layout.stacks[name][0] if name in layout.stacks else name for name in stored}
    tensors = converted({as_first[name]: w for name, w in stored.items()}, layout, config, compute_dtype, activations)
    places = tensor_places(config)
    firsts = [name for name in tensors if layout.stacks and len(places[name]) == 4]  # each stack's first expert
    stacks = {places[name][1:3]: tensors.pop(name) for name in firsts}
    return hf_to_params(tensors, config, stacks)


def _stacked(arrays: list):
    """One parameter as it is, several (a stage's experts) stacked: placeholders of the exported step only, which
    the bundle's stage read replaces (`lowering.stage_ring`)."""
    return arrays[0] if len(arrays) == 1 else stacked(arrays)


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
        if bits == 4 and packed.dtype == jnp.int8:  # the bytes, two values each (`with_expert_bytes`)
            values = jax.lax.bitcast_convert_type(packed, jnp.uint8)
            tensors[name] = QuantizedWeight(values, scale, activation, row_block_for((values.shape[-2], 2 *
                                            values.shape[-1])), hoist_barrier=False, offset=0 if layout.signed
                                            else 8, nibbles=True)
            continue
        values, offset = (packed, 0) if layout.signed else offset_values(packed, bits, activation)
        tensors[name] = QuantizedWeight(values, scale, activation, row_block_for(values.shape[-2:]),
                                        hoist_barrier=False, offset=offset)
    return tensors
