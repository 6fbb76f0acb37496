# pyright: reportRedeclaration=false
# (each step kind defines its own `run`: one name, one signature per branch)
"""The fixed-shape steps and compiled decode loops a bundle exports, each a flat function `(weights...,
inputs...) -> outputs` with its signature (`lowering.bundle_module` exports and merges them)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.forward import Context
from llada_jax.model.layout import LayoutRule
from llada_jax.model.readout import ReadoutSpec
from llada_jax.model.shapes import kv_shape, widths_within
from llada_jax.model.steps import full_forward, head_rows, read_out, scatter_slots, window_forward
from llada_jax.quant.quantize import Activations
from lowering.bundle_format import StepSpec
from lowering.bundle_params import params_of
from lowering.bundle_weights import WeightLayout
from policies.block_loop import block_loop
from policies.block_loop_io import BlockLoopInputs, BlockLoopOutputs, BlockLoopSpec
from policies.decode_loop import decode_loop
from policies.loop_io import LoopInputs, LoopOutputs, LoopSpec

ARGMAX = ReadoutSpec(kind="argmax")


NAMED_WEIGHTS = ("full", "window", "read")  # kinds that read the weights as named parameters


def canvas_sizes(max_len: int) -> list[int]:
    """The canvas shapes of a bundle whose longest canvas is `max_len`."""
    return widths_within(max_len)


def step_specs(max_len: int, max_window: int, batch_sizes: tuple[int, ...] = (1,),
               block_length: int | None = None) -> list[StepSpec]:
    """Every shape the decoders can ask for with canvases up to `max_len` and windows up to `max_window`,
    for each batch size (rows of a batched step, `policies.step_batcher`); with `block_length`, only those
    block diffusion's decoder asks for with blocks of that length."""
    if block_length is not None:
        return [spec for batch in batch_sizes for spec in _block_step_specs(max_len, block_length, batch)]
    return [spec for batch in batch_sizes for spec in _step_specs(max_len, max_window, batch)]


def _block_step_specs(max_len: int, block_length: int, batch: int) -> list[StepSpec]:
    """A block against the cache on every canvas that holds one (`policies.block_diffusion`: canvases are whole
    blocks, padded to a shape bucket), its K/V committed, and its rows read out: the model's layers run in one
    step shape per canvas, not in every window width."""
    specs = []
    for slots in canvas_sizes(max_len):
        if slots >= block_length:
            specs += [StepSpec("window", batch, slots, block_length), StepSpec("commit", batch, slots, block_length)]
    return specs + [StepSpec("read", batch, block_length, width) for width in widths_within(block_length)]


def _step_specs(max_len: int, max_window: int, batch: int) -> list[StepSpec]:
    specs = []
    for slots in canvas_sizes(max_len):
        specs.append(StepSpec("full", batch, slots))
        specs.append(StepSpec("commit", batch, slots, slots))
        specs += [StepSpec("read", batch, slots, width) for width in widths_within(slots)]
        for width in widths_within(slots):
            if width <= max_window:
                specs.append(StepSpec("window", batch, slots, width))
                if width < slots:
                    specs.append(StepSpec("commit", batch, slots, width))
    return specs


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def io_signature(spec: StepSpec, config: LLaDAConfig, compute_dtype) -> tuple[list, list]:
    """(inputs, outputs) of a step as [(name, ShapeDtypeStruct)], weights excluded, in call order."""
    b, s, w = spec.batch, spec.slots, spec.width
    cache = kv_shape(config, b, s)
    e = config.embedding_size
    extras = [("cfg_scale", _sds((), jnp.float32)), ("logit_bias", _sds((e,), jnp.float32)),
              ("confidence_bias", _sds((e,), jnp.float32))]
    if spec.kind == "read":  # the head on `w` of a step's `s` hidden rows, those at `head_rows`
        inputs = [("hidden", _sds((b, s, config.d_model), compute_dtype)), ("head_rows", _sds((w,), jnp.int32)),
                  *extras]
        return inputs, [("x0", _sds((b, w), jnp.int32)), ("logp", _sds((b, w), jnp.float32))]
    if spec.kind == "full":
        inputs = [("tokens", _sds((b, s), jnp.int32)), ("valid", _sds((b, s), jnp.int32))]
        width = s
    elif spec.kind == "window":
        inputs = [("keys", _sds(cache, compute_dtype)), ("values", _sds(cache, compute_dtype)),
                  ("context_bias", _sds((b, s), jnp.float32)), ("window_ids", _sds((b, w), jnp.int32)),
                  ("window_pos", _sds((b, w), jnp.int32)), ("window_valid", _sds((b, w), jnp.int32))]
        width = w
    else:
        proposed = kv_shape(config, b, w)
        inputs = [("keys", _sds(cache, compute_dtype)), ("values", _sds(cache, compute_dtype)),
                  ("targets", _sds((b, w), jnp.int32)), ("new_keys", _sds(proposed, compute_dtype)),
                  ("new_values", _sds(proposed, compute_dtype))]
        return inputs, [("keys", _sds(cache, compute_dtype)), ("values", _sds(cache, compute_dtype))]
    proposed = kv_shape(config, b, width)
    outputs = [("hidden", _sds((b, width, config.d_model), compute_dtype)),
               ("new_keys", _sds(proposed, compute_dtype)), ("new_values", _sds(proposed, compute_dtype))]
    return inputs, outputs


def step_function(spec: StepSpec, config: LLaDAConfig, layout: WeightLayout, compute_dtype, activations: Activations,
                  layout_rule: LayoutRule):
    """The flat function to export: weights (as stored, see `params_of`), then inputs. `commit` only
    scatters K/V and takes no weights. `layout_rule`:
    the target's activation layouts (`lowering.targets`)."""
    def params_from(weights):
        return params_of(weights, layout, config, compute_dtype, activations)

    if spec.kind == "full":
        def run(weights, tokens, valid):
            return tuple(full_forward(params_from(weights), tokens, valid > 0, config, layout_rule))
    elif spec.kind == "window":
        def run(weights, keys, values, context_bias, ids, pos, valid):
            context = Context(keys, values, context_bias)
            return tuple(window_forward(params_from(weights), context, ids, pos, valid > 0, config, layout_rule))
    elif spec.kind == "read":
        def run(weights, hidden, rows, cfg_scale, logit_bias, confidence_bias):
            hidden = head_rows(hidden, rows)
            out = read_out(params_from(weights), hidden, cfg_scale, logit_bias, confidence_bias, ARGMAX, layout_rule)
            return out.x0, out.logp
    else:
        def run(keys, values, targets, new_keys, new_values):
            return scatter_slots(keys, targets, new_keys), scatter_slots(values, targets, new_values)
    return run


class Function(NamedTuple):
    """One function of a bundle: its name, whether it reads the weights as named parameters, its
    inputs and outputs as [(name, ShapeDtypeStruct)] (weights excluded) and the flat function to export."""

    name: str
    named_weights: bool
    inputs: list
    outputs: list
    run: Callable


def step(spec: StepSpec, config: LLaDAConfig, compute_dtype, layout: WeightLayout, activations: Activations,
         layout_rule: LayoutRule) -> Function:
    inputs, outputs = io_signature(spec, config, compute_dtype)
    return Function(spec.name, spec.kind in NAMED_WEIGHTS, inputs, outputs,
                    step_function(spec, config, layout, compute_dtype, activations, layout_rule))


def loop(spec: LoopSpec, config: LLaDAConfig, compute_dtype, layout: WeightLayout, activations: Activations,
         layout_rule: LayoutRule) -> Function:
    """The whole decode loop of `spec` (`policies.decode_loop`), weights as named parameters."""
    s, g, e, m = spec.slots, spec.schedule.gen_length, config.embedding_size, spec.max_passes
    shapes = {"prompt": (s,), "prompt_len": (), "logit_bias": (e,), "confidence_bias": (e,), "commit_cutoff": (),
              "draft_cutoff": (), "generated": (g,), "nfe": (), "commit_nfe": (g,), "commit_logp": (g,),
              "step_block": (m,), "step_width": (m,), "step_real": (m,), "step_useful": (m,), "bad_pass": (),
              "bad_position": ()}
    floats = ("logit_bias", "confidence_bias", "commit_cutoff", "draft_cutoff", "commit_logp")

    def signature(fields):
        return [(name, _sds(shapes[name], jnp.float32 if name in floats else jnp.int32)) for name in fields]

    def run(weights, *loop_inputs):
        params = params_of(weights, layout, config, compute_dtype, activations)
        return tuple(decode_loop(params, LoopInputs(*loop_inputs), config=config, spec=spec, kv_dtype=compute_dtype,
                                 layout_rule=layout_rule))

    return Function(spec.name, True, signature(LoopInputs._fields), signature(LoopOutputs._fields), run)


def block_loop_function(spec: BlockLoopSpec, config: LLaDAConfig, compute_dtype, layout: WeightLayout,
                        activations: Activations, layout_rule: LayoutRule) -> Function:
    """The whole block-diffusion loop of `spec` (`policies.block_loop`), weights as named parameters."""
    s, g, p, r, b = spec.slots, spec.gen_length, spec.max_passes, spec.read_width, spec.block_length
    shapes = {"prompt": (s,), "generated": (g,), "pass_block": (p,), "pass_width": (p,), "pass_rows": (p,),
              "written": (p, r), "x0": (p, r), "logp": (p, r), "edited": (p, b), "old": (p, b)}
    kinds = {"commit_cutoff": jnp.float32, "edit_cutoff": jnp.float32, "draft_cutoff": jnp.float32,
             "logp": jnp.float32, "written": jnp.bool_, "edited": jnp.bool_}

    def signature(fields):
        return [(name, _sds(shapes.get(name, ()), kinds.get(name, jnp.int32))) for name in fields]

    def run(weights, *loop_inputs):
        params = params_of(weights, layout, config, compute_dtype, activations)
        return tuple(block_loop(params, BlockLoopInputs(*loop_inputs), config=config, spec=spec,
                                kv_dtype=compute_dtype, layout_rule=layout_rule))

    return Function(spec.name, True, signature(BlockLoopInputs._fields), signature(BlockLoopOutputs._fields), run)


def weight_structs(layout: WeightLayout) -> list[jax.ShapeDtypeStruct]:
    return [_sds(p.shape, jnp.dtype(p.dtype)) for p in layout.parameters]


def _describe(items) -> list[dict]:
    return [{"name": n, "shape": list(s.shape), "dtype": str(np.dtype(s.dtype))} for n, s in items]


def signature_manifest(spec: StepSpec, config: LLaDAConfig, compute_dtype) -> dict:
    """The manifest entry of a step: name, shapes and argument order."""
    inputs, outputs = io_signature(spec, config, compute_dtype)
    return {"name": spec.name, "kind": spec.kind, "batch": spec.batch, "slots": spec.slots, "width": spec.width,
            "inputs": _describe(inputs), "outputs": _describe(outputs)}


def loop_manifest(spec: LoopSpec | BlockLoopSpec, function: Function) -> dict:
    """The manifest entry of a compiled decode loop: its setting, shapes and argument order."""
    return {"name": function.name, "kind": "block_loop" if isinstance(spec, BlockLoopSpec) else "loop",
            "loop": spec.manifest(),
            "inputs": _describe(function.inputs), "outputs": _describe(function.outputs)}
