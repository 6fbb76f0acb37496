"""The weights a bundle's steps declare (`lowering.bundle_weights.WeightLayout`), decided once per compile: which
matrices our kernels multiply, whether the program streams its layers under a device memory budget, and whether an
MoE's experts are stacked (streamed through the ring, or resident in the bundle's own archive).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from llada_jax.quant.choice import Kernels, check_activations
from llada_jax.quant.quantize import Activations
from llada_jax.system.errors import LladaError
from lowering.bundle_weights import (
    WeightLayout,
    weight_layout,
    with_expert_bytes,
    with_kernels,
    with_stacked_experts,
)
from lowering.kernel_dispatch import kernel_compiler
from lowering.stage_ring import SLOTS, byte_size, resident_bytes, ring_plan


def bundle_layout(tgt, model_dir: Path, config, kernels: Kernels, activations: Activations, archive: bool,
                  budget: int | None) -> tuple:
    """(the C compiler command building our kernels for `tgt`, or None; the layout of `model_dir`'s weights as the
    steps declare them). `archive`: the bundle holds its weights as its own archive (signed integers; an MoE's
    experts stacked where they stay resident). The activations are checked against what will run them."""
    layout = weight_layout(model_dir, config)
    compiler = kernel_compiler(tgt, layout, kernels)
    check_activations(activations, layout.quantized, "own" if compiler else "compiler")
    if compiler:
        layout = with_kernels(layout, activations, config)
    layout = _streaming(config, dataclasses.replace(layout, signed=archive), budget)
    stacked = archive and not layout.streamed and bool(config.n_experts)  # streamed, the ring stacks them
    if layout.streamed or stacked:
        layout = with_expert_bytes(layout, config)
    if stacked:
        layout = with_stacked_experts(layout, config)
    _note_expert_loops(config, layout)
    return compiler, layout


def _streaming(config, layout: WeightLayout, budget: int | None) -> WeightLayout:
    """The layout as the budget holds it: resident if it holds every weight, as the bundle stores them; else the
    program streams its layers and head through a ring of stage-sized buffers (`lowering.stage_ring`) beside the
    resident embedding; where those do not fit either, the embedding streams too (every pass reads all its rows,
    where a step needs only its canvas's)."""
    if budget is not None and budget <= 0:
        raise LladaError(f"device memory budget must be a positive number of bytes, got {budget}")
    if budget is None or budget >= sum(byte_size(p) for p in layout.parameters):
        return layout
    streamed = dataclasses.replace(layout, streamed=True)
    if budget >= _needed(streamed, config):
        return streamed
    everything = dataclasses.replace(streamed, streams_embedding=True)
    if budget < _needed(everything, config):
        raise LladaError(f"a device memory budget of {budget:,} bytes is too small for this model: streaming its "
                         f"weights needs {_needed(everything, config):,} ({SLOTS} stages, each a layer or a chunk of "
                         "the LM head or the embedding)")
    return everything


def _needed(layout: WeightLayout, config) -> int:
    return resident_bytes(layout, config) + ring_plan(layout, config).ring_bytes


# A step holds a loop per expert per sparse layer where its experts are not stacked (resident in the checkpoint's
# own files), and IREE's compile time grows faster than the loops (docs/iree-limits.md; eval/RESULTS.md, "LLaDA2").
SLOW_EXPERT_LOOPS = 256


def _note_expert_loops(config, layout: WeightLayout) -> None:
    loops = config.n_experts * (config.n_layers - config.dense_layers)
    if loops > SLOW_EXPERT_LOOPS and not layout.streamed and not layout.stacks:
        print(f"llada: this bundle's steps hold {loops} expert loops, which IREE compiles slowly (hours at "
              "LLaDA2.0-mini's size): its weights are the checkpoint's files, whose experts are not stacked. A CPU "
              "bundle that copies its weights (no --link-weights) stacks them", file=sys.stderr)
