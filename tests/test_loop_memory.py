"""The compiled decode loop holds no second copy of the weights, whatever form they are stored in.

XLA moves work that does not change between iterations out of a while body. For weights stored as
anything but float32 that work is a whole-model copy: a float32 conversion of int8 or group-wise int4
weights, a transposed bf16 copy for its CPU matmul, a float32 bf16 embedding table. At LLaDA-8B's
shapes each of these ran the machine out of memory (bf16: 24 GB resident before the OOM killer). The
loop is compiled here without running it, on shapes where the weights dwarf the activations, and its
temporaries are held below two float32 matrices (a step may dequantize one matrix at a time).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llada_jax.kernels import xla as own_kernels
from llada_jax.model.params import init_params
from llada_jax.model.readout import TokenBiases
from llada_jax.quant.qlinear import QuantizedWeight
from policies.cache_policies import Vanilla
from policies.decode_loop import decode_loop
from policies.loop_io import LoopInputs, LoopSpec, loop_inputs
from policies.schedule import Schedule
from tests.conftest import TINY, require

# Wide enough that the weights (3.4 M parameters) dwarf the activations of an 8-position step.
CONFIG = dataclasses.replace(TINY, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, mlp_hidden_size=768,
                             vocab_size=1024, embedding_size=1024, mask_token_id=1000)
SPEC = LoopSpec(policy=Vanilla(), threshold_rule=False, lookahead=0, spec_width=0, schedule=Schedule(4, 4, 2),
                slots=8)
FORMS = {  # name -> (compute dtype, how a [O, I] matrix is stored)
    "bfloat16": ("bfloat16", None),
    "int8 per channel": ("float32", (jnp.int8, 1, "float")),
    "int8 W8A8": ("float32", (jnp.int8, 1, "int8")),
    "int4 group 32": ("float32", (jnp.int4, 32, "float")),
    "int4 group 32, our W4A16 kernel": ("float32", ("w4a16", 32, "float")),
    "int4 group 32, our W4A8 kernel": ("float32", ("w4a8", 32, "int8")),
    "int8, our W8A8 kernel": ("float32", ("w8a8", 1, "int8")),
}


def scales(rows: int, groups: int, dtype=jnp.float32):
    return jax.ShapeDtypeStruct((rows, groups), dtype)


def abstract_params(dtype: str, stored) -> dict:
    params = jax.eval_shape(lambda: init_params(CONFIG, 0, dtype))
    if stored is None:
        return params
    kind, group, activations = stored

    def quantized(path, leaf):
        name = jax.tree_util.keystr(path)
        if len(leaf.shape) != 2:
            return leaf
        rows, columns = leaf.shape
        if "wte" in name:  # the embedding: int8, one scale per row, whatever the layers are
            return QuantizedWeight(jax.ShapeDtypeStruct(leaf.shape, jnp.int8), scales(rows, 1))
        groups = 1 if group == 1 else columns // group
        if isinstance(kind, str):  # our kernel's: the stored bytes held as int8 (as uint8 XLA copied them all)
            bits = 8 if kind == "w8a8" else 4
            return QuantizedWeight(jax.ShapeDtypeStruct((rows, columns * bits // 8), jnp.int8), scales(rows, groups),
                                   activations, offset=1 << (bits - 1), nibbles=bits == 4, kernel=kind)
        return QuantizedWeight(jax.ShapeDtypeStruct(leaf.shape, kind), scales(rows, groups),
                               activations if "blocks" in name else "float")

    return jax.tree_util.tree_map_with_path(quantized, params)


def largest_float32_matrix(params) -> int:
    return max(int(np.prod(leaf.shape)) * 4 for leaf in jax.tree.leaves(params))


def loop_temporaries(params, dtype: str) -> int:
    inputs = loop_inputs(np.arange(4, dtype=np.int32), SPEC, TokenBiases.build(CONFIG.embedding_size), None, 1.0)
    inputs = LoopInputs(*(jnp.asarray(value) for value in inputs))
    compiled = decode_loop.lower(params, inputs, config=CONFIG, spec=SPEC, kv_dtype=jnp.dtype(dtype)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.slow
def test_compiled_loop_temporaries_stay_below_two_float32_matrices(form):
    dtype, stored = FORMS[form]
    if "our" in form:
        require(own_kernels.available() is not None, "a C compiler (gcc or clang, with c++)")
    params = abstract_params(dtype, stored)
    temp = loop_temporaries(params, dtype)
    assert temp < 2 * largest_float32_matrix(params), (form, temp, largest_float32_matrix(params))


def stored_nibbles(scale_dtype) -> dict:
    """int4 group 8 as a checkpoint's own bytes (two offset values per byte), scales in `scale_dtype`."""
    def as_stored(path, leaf):
        if len(leaf.shape) != 2:
            return leaf
        rows, columns = leaf.shape
        return QuantizedWeight(jax.ShapeDtypeStruct((rows, columns // 2), jnp.uint8),
                               scales(rows, 1 if "wte" in jax.tree_util.keystr(path) else columns // 8, scale_dtype),
                               offset=8, nibbles=True)

    return jax.tree_util.tree_map_with_path(as_stored, jax.eval_shape(lambda: init_params(CONFIG, 0, "float32")))


@pytest.mark.slow
def test_stored_scales_are_widened_inside_the_step_not_ahead_of_the_loop():
    """bf16 scales are widened a few rows at a time inside the step: the loop holds about what it holds with
    float32 scales (widened ahead of the loop, they were a float32 copy of every scale)."""
    bf16, f32 = (loop_temporaries(stored_nibbles(dtype), "float32") for dtype in (jnp.bfloat16, jnp.float32))
    every_scale = sum(int(np.prod(w.scale.shape)) * 4 for w in jax.tree.leaves(
        stored_nibbles(jnp.bfloat16), is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight)) if hasattr(w, "scale"))
    assert bf16 - f32 < every_scale / 2, (bf16, f32, every_scale)  # one widened row block of them at a time


@pytest.mark.slow
def test_iree_loop_dequantizes_inside_its_steps(tmp_path, monkeypatch):
    """iree-compile hoists loop-invariant work out of a loop: a group-wise dequantization left invariant (the
    peeled first pass of a cached decoder) became one transient holding every weight's float copy. The loop's
    largest transient stays below a quarter of the weights' float32 copies (hoisted, it exceeds all of them),
    read from the stream IR iree-compile allocates before it generates code."""
    from iree.compiler.tools.binaries import find_tool

    from llada_jax.quant.quantize import QuantScheme
    from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
    from lowering import bundle as bundle_mod
    from lowering.export import canvas_sizes
    from policies.compiled_loop import baked_loops
    from tests.conftest import write_checkpoint

    scheme = QuantScheme(4, 32)
    model = quantize_checkpoint(write_checkpoint(tmp_path / "src", CONFIG), tmp_path / "q", scheme, head=scheme)
    captured = {}

    class Exported(Exception):
        """Stops `compile_bundle` once the module is exported: the stream IR is all this test reads."""

    def capture(text, flags, *args, **kwargs):
        captured.update(text=text, flags=flags)
        raise Exported

    monkeypatch.setattr(bundle_mod, "compile_module", capture)
    loops = (baked_loops("dual-cache", None, 8, 8, 8, canvas_sizes(16)),)
    with pytest.raises(Exported):
        bundle_mod.compile_bundle(model, "host", tmp_path / "bundle", max_len=16, window=8, loops=loops)
    source, stream = tmp_path / "loop.mlir", tmp_path / "loop.stream.mlir"
    source.write_text(captured["text"])
    subprocess.run([find_tool("iree-compile"), str(source), "--iree-input-type=stablehlo", *captured["flags"],
                    "--compile-to=stream", "-o", str(stream)], check=True, capture_output=True, timeout=600)
    text = stream.read_text()
    start = text.index("util.func public @loop_")
    body = text[start:text.find("\n  util.func", start + 1)]
    largest = max(int(size) for size in re.findall(r"!stream\.resource<transient>\{%c(\d+)\}", body))
    float32_weights = 4 * CONFIG.n_layers * (4 * CONFIG.d_model ** 2 + 3 * CONFIG.d_model * CONFIG.mlp_hidden_size)
    assert largest < float32_weights / 4, (largest, float32_weights)
