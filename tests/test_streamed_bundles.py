"""Streamed bundles (`lowering.stage_ring`): under a device memory budget below the weights, the IREE program
reads each layer and the LM head into a ring of two device buffers itself. Streamed generation equals resident
generation (the Python runtime and `run.sh`, float and quantized, host and arm64 under qemu; a 60-layer model in
`tests/test_streamed_deep_model.py`), the streamed weights are never declared resident, and a budget the ring
cannot fit is refused before compiling. Each bundle is compiled once per module: IREE compiles of this model take
minutes on slow CPUs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowering.bundle as bundle_mod
from llada_jax.quant.quantize import QuantScheme
from llada_jax.system.errors import LladaError
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
from lowering.bundle import compile_bundle
from lowering.bundle_weights import weight_layout
from lowering.export import canvas_sizes
from lowering.stage_ring import ALIGNMENT, ITEM_BYTES, byte_size, group_of, resident_bytes, ring_plan
from policies.compiled_loop import baked_loops
from tests.conftest import TINY, bundle_weight_bytes, cli_flags, write_checkpoint

# Sixteen layers: a stage is a small part of the weights, so 50% and 25% budgets stream. The LM head is twice a
# layer, so it streams in three chunks of rows, the last one short (256, 256, 88).
DEEP = dataclasses.replace(TINY, n_layers=16, vocab_size=600, embedding_size=600, mask_token_id=120,
                           eos_token_id=121, eot_token_id=122)
POLICIES = ["vanilla", "prefix-cache", "dual-cache", "dual-cache+speculative:1:0.3+revision:0.5"]
SETTING = dict(gen_length=16, block_length=8, steps=16)


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("deep") / "model", DEEP, std=0.3)


def test_ring_plan_holds_each_stage_in_one_slot(deep_dir):
    layout = weight_layout(deep_dir, DEEP)
    plan = ring_plan(layout, DEEP)
    assert len(plan.stages) == DEEP.n_layers + 3 and plan.chunks == ((0, 256), (256, 256), (512, 88))
    assert plan.head == range(DEEP.n_layers, DEEP.n_layers + 3) and not plan.embedding
    staged = {key: "lm_head" if index in plan.head else index for index, stage in enumerate(plan.stages)
              for piece in stage for key in piece.keys}
    for parameter in layout.parameters:
        group = group_of(parameter, layout, DEEP)  # layer i's tensors in stage i, the head's in its chunks
        assert staged.get(parameter.name) == group
        if group is None:
            assert parameter.name.startswith(("model.transformer.wte", "model.transformer.ln_f"))
    for stage in plan.stages:
        ends = [piece.offset + piece.length for piece in stage]
        assert all(piece.offset % ALIGNMENT == 0 for piece in stage)
        assert all(end <= following.offset for end, following in zip(ends, stage[1:]))  # no overlap
        assert max(ends) <= plan.slot_bytes
    assert resident_bytes(layout, DEEP) + sum(piece.length for s in plan.stages for piece in s) == bundle_weight_bytes(
        deep_dir)


@settings(max_examples=60, deadline=None)
@given(d_model=st.sampled_from([8, 16, 32, 64]), vocab=st.integers(1, 5000), layers=st.integers(1, 3),
       hidden=st.sampled_from([16, 64, 256]), dtype=st.sampled_from(["float32", "bfloat16"]), embedding=st.booleans())
def test_the_lm_head_streams_in_row_chunks_no_larger_than_a_layer(d_model, vocab, layers, hidden, dtype, embedding):
    """The head's chunks (and a streamed embedding's) read each of its tensors once, row after row; each chunk is
    whole workgroups of rows (but the last) and within a layer's bytes but for rounding up to a workgroup; no more
    chunks than that needs. Only the final norm stays resident when the embedding streams."""
    from llada_jax.model.params import hf_shapes
    from lowering.bundle_weights import Parameter, WeightLayout
    from lowering.kernel_dispatch import ROWS_PER_WORKGROUP

    config = dataclasses.replace(TINY, d_model=d_model, n_heads=2, n_kv_heads=2, n_layers=layers,
                                 mlp_hidden_size=hidden, vocab_size=vocab, embedding_size=vocab, mask_token_id=0)
    layout = WeightLayout(tuple(Parameter(name, shape, dtype) for name, shape in hf_shapes(config).items()), {},
                          streamed=True, streams_embedding=embedding)
    plan = ring_plan(layout, config)
    layer_bytes = max(s[-1].offset + s[-1].length for s in plan.stages[:layers])  # a layer's extent in a slot
    assert resident_bytes(layout, config) == (1 + (not embedding) * vocab) * d_model * ITEM_BYTES[dtype]
    for part, stages in (("lm_head", plan.head), ("wte", plan.embedding)):
        matrices = [p for p in layout.parameters if group_of(p, layout, config) == part]
        assert bool(stages) == bool(matrices) == (part == "lm_head" or embedding)
        if not matrices:
            continue
        row_bytes = [byte_size(p) // vocab for p in matrices]
        assert 1 <= len(stages) <= -(-sum(map(byte_size, matrices)) // layer_bytes)
        assert sum(plan.chunks[i - layers][1] for i in stages) == vocab
        for c, index in enumerate(stages):
            first, rows = plan.chunks[index - layers]
            assert first == c * plan.chunks[stages[0] - layers][1]
            assert rows > 0 and (rows % ROWS_PER_WORKGROUP == 0 or c == len(stages) - 1 or rows == vocab)
            assert [read[0] for piece in plan.stages[index] for read in piece.reads()] == [p.name for p in matrices]
            assert [(p.start, p.length) for p in plan.stages[index]] == [(first * b, rows * b) for b in row_bytes]
            assert sum(p.length for p in plan.stages[index]) <= layer_bytes + ROWS_PER_WORKGROUP * sum(row_bytes)


def test_a_budget_the_ring_cannot_fit_is_refused_with_the_minimum(deep_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_mod, "compile_module", lambda *a: pytest.fail("iree-compile was called"))
    with pytest.raises(LladaError, match=r"too small for this model: streaming its weights needs [\d,]+ ") as err:
        compile_bundle(deep_dir, "host", tmp_path / "b", max_len=16, window=8, device_memory_budget=1000)
    assert "\n" not in str(err.value) and not (tmp_path / "b").exists()
    with pytest.raises(LladaError, match="--data-tiling needs resident weights"):
        compile_bundle(deep_dir, "host", tmp_path / "b", max_len=16, window=8, data_tiling=True,
                       device_memory_budget=bundle_weight_bytes(deep_dir) // 2)
    vanilla = (baked_loops("vanilla", None, 8, 8, 8, canvas_sizes(16)),)
    with pytest.raises(LladaError, match="fails to compile a vanilla decode loop that streams its weights"):
        compile_bundle(deep_dir, "host", tmp_path / "b", max_len=16, window=8, loops=vanilla,
                       device_memory_budget=bundle_weight_bytes(deep_dir) // 2)


def test_streamed_weights_are_not_declared_resident(deep_dir, monkeypatch, tmp_path):
    """Under the budget the module declares only the embedding and the final norm as parameters, each stage read
    by name; a budget that holds every weight keeps them all resident."""
    modules = []
    monkeypatch.setattr(bundle_mod, "compile_module", lambda module, *a: modules.append(module) or 0.0)
    monkeypatch.setattr(bundle_mod, "_write_manifest", lambda *a: None)
    for name, budget in (("a", bundle_weight_bytes(deep_dir) // 4), ("b", bundle_weight_bytes(deep_dir))):
        compile_bundle(deep_dir, "host", tmp_path / name, max_len=16, window=8, device_memory_budget=budget)
    declared = [line for line in modules[0].splitlines() if "#flow.parameter.named" in line]
    assert len(declared) == 2 and all("wte" in line or "ln_f" in line for line in declared)
    assert "io_parameters.gather" in modules[0] and "stablehlo.custom_call @llada_stage" not in modules[0]
    assert "io_parameters" not in modules[1] and modules[1].count("#flow.parameter.named") == len(
        weight_layout(deep_dir, DEEP).parameters)


class Bundles:
    """The module's bundles of the DEEP model, keyed by the checkpoint's bits (None: float), the activations, the
    target and the budget (None: resident)."""

    def __init__(self, deep_dir, root):
        self.models: dict[int | None, Path] = {None: deep_dir}
        self.root = root
        self.built: dict[tuple, Path] = {}

    def model(self, bits: int | None) -> Path:
        if bits not in self.models:
            scheme = QuantScheme(bits, 32 if bits == 4 else None)
            self.models[bits] = quantize_checkpoint(self.models[None], self.root / f"q{bits}", scheme)
        return self.models[bits]

    def __call__(self, bits=None, activations="float", target="host", budget=None):
        from llada_jax.cli import main

        key = (bits, activations, target, budget)
        if key not in self.built:
            out = self.root / f"bundle{len(self.built)}"
            extra = ["--device-memory-budget", str(budget)] if budget else []
            assert main(["compile", "--model", str(self.model(bits)), "--target", target, "--out", str(out),
                         "--max-len", "32", "--window", "16", "--activations", activations,
                         *cli_flags(SETTING), *extra]) == 0
            self.built[key] = out
        return self.built[key]


@pytest.fixture(scope="module")
def bundles(deep_dir, tmp_path_factory):
    return Bundles(deep_dir, tmp_path_factory.mktemp("bundles"))


@pytest.fixture(scope="module")
def streamed_pair(bundles, deep_dir):
    """The same steps and compiled loop, resident and streamed at a quarter of the weights."""
    return bundles(), bundles(budget=bundle_weight_bytes(deep_dir) // 4)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(policy=st.sampled_from(POLICIES), seed=st.integers(0, 1000), length=st.integers(1, 14))
def test_streamed_bundle_generates_the_resident_tokens(streamed_pair, policy, seed, length):
    from llada_jax.bundle_runner import bundle_runner

    resident, streamed = streamed_pair
    assert json.loads((streamed / "manifest.json").read_text())["streamed"]["ring_bytes"] > 0
    assert json.loads((resident / "manifest.json").read_text())["streamed"] is None
    prompt = np.random.default_rng(seed).integers(0, DEEP.mask_token_id, length)
    want = bundle_runner(resident)[2](prompt, policy=policy, **SETTING).output_ids.tolist()
    assert bundle_runner(streamed)[2](prompt, policy=policy, **SETTING).output_ids.tolist() == want


def run_script(bundle, ids: str, command: str | None = None) -> str:
    """The ids `run.sh` prints, run by `command` (the host's own iree-run-module by default)."""
    from tests.test_decode_loop_bundle import host_iree_run_module

    env = dict(os.environ, IREE_RUN_MODULE=command or str(host_iree_run_module()))
    proc = subprocess.run([str(bundle / "run.sh"), ids], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[-1]


def smallest_budget(model, activations: str, out) -> int:
    """The smallest device memory budget a bundle of `model` accepts: the one its refusal names."""
    with pytest.raises(LladaError) as refused:
        compile_bundle(model, "host", out, max_len=32, window=16, activations=activations, device_memory_budget=1)
    return int(re.search(r"needs ([\d,]+)", str(refused.value))[1].replace(",", ""))  # type: ignore[index]


def xla_ids(capsys, model, ids: str, setting: dict) -> str:
    """The ids `llada generate` prints for a float checkpoint (XLA), as `run.sh` prints them: every float
    bundle's tokens (`tests/test_decode_loop_bundle.py`)."""
    from llada_jax.cli import main

    capsys.readouterr()
    assert main(["generate", "--model", str(model), "--prompt-ids", ids, "--json", *cli_flags(setting)]) == 0
    return ",".join(map(str, json.loads(capsys.readouterr().out)["output_ids"]))


@pytest.mark.slow
@pytest.mark.parametrize("bits, activations, fraction", [(None, "float", 0.25), (8, "int8", 0.25), (4, "float", 0.5),
                                                         (None, "float", None), (4, "int8", None)],
                         ids=["float-25%", "w8a8-25%", "w4a16-50%", "float-least", "w4a8-least"])
def test_run_script_streams_what_the_resident_bundle_generates(bundles, tmp_path, bits, activations, fraction):
    """No Python: `run.sh` of a streamed bundle prints the resident bundle's ids, float and quantized; at the
    smallest budget accepted (`least`) the embedding streams too."""
    model = bundles.model(bits)
    least = smallest_budget(model, activations, tmp_path / "refused")
    streamed = bundles(bits, activations, budget=least if fraction is None else int(fraction * bundle_weight_bytes(
        model)))
    plan = json.loads((streamed / "manifest.json").read_text())["streamed"]
    assert plan["embedding_streamed"] == (fraction is None) and plan["ring_bytes"] <= least
    for ids in ("1,2,3", "9,8,7,6,5,4,3,2,1,0,11"):
        assert run_script(streamed, ids) == run_script(bundles(bits, activations), ids)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [None, 4], ids=["float", "w4a8"])
def test_streamed_arm64_run_script_under_qemu_prints_the_host_ids(bundles, bits):
    """The aarch64 bundle streamed at a third of its weights prints what the resident host bundle prints (W4A8:
    our arm64 kernels on the streamed bytes)."""
    from llada_jax.system.locations import user_cache_dir
    from lowering.emulation import QEMU, SYSROOT, emulator_available, runtime_tools_dir
    from tests.conftest import require

    require(emulator_available(), "user-mode qemu with arm64 libraries")
    tools = runtime_tools_dir(user_cache_dir("tools"))
    activations = "float" if bits is None else "int8"
    arm = bundles(bits, activations, "linux-arm64", bundle_weight_bytes(bundles.model(bits)) // 3)
    command = f"{QEMU} -L {SYSROOT} {tools / 'iree-run-module'}"
    assert run_script(arm, "1,2,3", command) == run_script(bundles(bits, activations), "1,2,3")
