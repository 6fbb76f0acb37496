"""The sparse MoE layer's experts accumulate in chains (`llada_jax.model.moe.CHAIN_EXPERTS`): every chain length
gives the one-chain sums bit for bit, and a model with more experts than IREE's stream analysis follows in one
chain compiles to a bundle that gives XLA's tokens. Stacked experts (XLA with our kernels; bundles, streamed or
resident in their archive) give the listed experts' sums bit for bit, through our routed kernels or one loop over
every expert's tiles."""

from __future__ import annotations

import dataclasses
import functools
import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.kernels import xla as own_kernels
from llada_jax.model import moe
from llada_jax.quant.qlinear import to_device
from llada_jax.quant.quantize import HostQuantized, QuantScheme, quantize_matrix
from tests.conftest import bundle_weight_bytes, write_checkpoint
from tests.test_llada2 import CONFIG, REFERENCE_CONFIG

D_MODEL, HIDDEN = 8, 4


def routed(n_experts: int, rows: int, top: int, seed: int, dtype) -> tuple:
    """A block of `n_experts` random SwiGLU experts, `rows` rows and a random routing of each to `top` experts."""
    rng = np.random.default_rng(seed)
    block = {key: [jnp.asarray(rng.normal(size=shape), dtype) for _ in range(n_experts)]
             for key, shape in (("experts_gate", (HIDDEN, D_MODEL)), ("experts_up", (HIDDEN, D_MODEL)),
                                ("experts_down", (D_MODEL, HIDDEN)))}
    experts = np.stack([rng.choice(n_experts, size=top, replace=False) for _ in range(rows)])
    return (block, jnp.asarray(rng.normal(size=(rows, D_MODEL)), dtype), jnp.asarray(experts, jnp.int32),
            jnp.asarray(rng.random((rows, top)), jnp.float32))


@pytest.mark.slow  # a fresh XLA compile per example: ~1 s each
@settings(max_examples=25, deadline=None)
@given(n_experts=st.integers(1, 12), rows=st.integers(1, 9), top=st.integers(1, 3), chain=st.integers(1, 13),
       seed=st.integers(0, 2**16), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_every_chain_length_gives_the_one_chain_sums(n_experts, rows, top, chain, seed, dtype):
    args = routed(n_experts, rows, min(top, n_experts), seed, dtype)
    with mock.patch.object(moe, "CHAIN_EXPERTS", n_experts):
        one_chain = np.asarray(moe.routed_sum(*args), np.float32)
    with mock.patch.object(moe, "CHAIN_EXPERTS", chain):
        chained = np.asarray(moe.routed_sum(*args), np.float32)
    np.testing.assert_array_equal(chained, one_chain)


# (bits, group, activations, kernels): float weights, then quantized through XLA's code or through our kernels
WEIGHTS = [None, (4, 32, "float", "compiler"), (8, None, "int8", "compiler"), (4, 32, "int8", "own"),
           (4, 64, "float", "own"), (8, None, "int8", "own")]


def quantized(block: dict, bits: int, group: int | None, activations: str, kernels: str) -> dict:
    scheme = QuantScheme(bits, group)
    return {key: [to_device(HostQuantized.of(*quantize_matrix(np.asarray(m, np.float32), scheme), scheme),
                            activations, kernels=kernels) for m in matrices] for key, matrices in block.items()}


@pytest.mark.slow  # a fresh XLA compile per example
@settings(max_examples=30, deadline=None)
@given(n_experts=st.integers(1, 12), rows=st.integers(1, 9), top=st.integers(1, 3), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), weights=st.sampled_from(WEIGHTS))
def test_stacked_experts_give_the_listed_experts_sums(n_experts, rows, top, seed, dtype, weights):
    if weights and weights[3] == "own" and own_kernels.available() is None:
        pytest.skip("no C compiler for our kernels")
    with mock.patch.multiple(__name__, D_MODEL=64, HIDDEN=64):  # whole blocks of 32 columns for the kernels
        block, *rest = routed(n_experts, rows, min(top, n_experts), seed, dtype)
    if weights:
        block = quantized(block, *weights)
    stacked = {key: jax.tree.map(lambda *parts: jnp.stack(parts), *matrices) for key, matrices in block.items()}
    listed = np.asarray(moe.routed_sum(block, *rest), np.float32)
    np.testing.assert_array_equal(np.asarray(moe.routed_sum(stacked, *rest), np.float32), listed)


@pytest.mark.slow
def test_more_experts_than_one_iree_chain_compile_and_give_the_xla_tokens(tmp_path):
    """40 experts: in one chain iree-compile failed without a message (from 36 on, IREE 3.13)."""
    from llada_jax.bundle_runner import bundle_runner
    from lowering.bundle import compile_bundle

    config = dataclasses.replace(CONFIG, n_experts=40, n_layers=2)
    checkpoint = write_checkpoint(tmp_path / "model", config, std=0.4)
    (checkpoint / "config.json").write_text(json.dumps(dict(REFERENCE_CONFIG, num_experts=40, num_hidden_layers=2)))
    _, _, generate_bundled = bundle_runner(compile_bundle(checkpoint, "host", tmp_path / "bundle", max_len=16,
                                                          window=8))
    options = dict(gen_length=8, block_length=8, steps=4, threshold=0.3, policy="dual-cache", loop="host")
    assert (generate_bundled(np.arange(1, 7), **options).output_ids.tolist()
            == llada_jax.generate(llada_jax.load(checkpoint), np.arange(1, 7), **options).output_ids.tolist())


def int4_llada2(tmp_path) -> tuple:
    """(config, checkpoint): a tiny LLaDA2 whose every matrix our kernels take (whole blocks of 32 columns),
    quantized to int4 groups of 32."""
    from llada_jax.weights.quantize_checkpoint import quantize_checkpoint

    if own_kernels.available() is None:
        pytest.skip("no C compiler for our kernels")
    widths = dict(mlp_hidden_size=32, shared_expert_size=32, dense_hidden_size=64, n_experts=12)
    config = dataclasses.replace(CONFIG, **widths)
    source = write_checkpoint(tmp_path / "model", config, std=0.4)
    (source / "config.json").write_text(json.dumps(dict(REFERENCE_CONFIG, num_experts=12, moe_intermediate_size=32,
                                                        intermediate_size=64)))
    return config, quantize_checkpoint(source, tmp_path / "int4", QuantScheme(4, 32), head=QuantScheme(4, 32))


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["int8", "float"])
def test_xla_holds_experts_our_kernels_take_stacked_and_decodes_as_with_a_loop_per_expert(tmp_path, activations):
    """Loaded with our kernels, every expert matrix stacked (one routed call per kind, and a whole-step program even
    past `loading.WHOLE_STEP_EXPERT_LOOPS`); loaded as lists (layer by layer, a loop per expert), the same tokens."""
    from llada_jax.weights import loading

    config, checkpoint = int4_llada2(tmp_path)
    with mock.patch.object(loading, "WHOLE_STEP_EXPERT_LOOPS", 0):
        model = llada_jax.load(checkpoint, dtype="float32", activations=activations)
        with mock.patch.object(loading, "kernels_take_experts", lambda *args: False):  # lists: layer by layer
            looped = llada_jax.load(checkpoint, dtype="float32", activations=activations)
    assert not model.layered and looped.layered
    assert model.params["blocks"][config.dense_layers]["experts_gate"].values.shape[0] == config.n_experts
    _assert_same_tokens(functools.partial(llada_jax.generate, model), functools.partial(llada_jax.generate, looped))


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["int8", "float"])
def test_xla_stages_experts_our_kernels_take_stacked_and_gives_the_resident_tokens(tmp_path, activations):
    """Staged under a budget (`llada_jax.staging.swap.pack_weights`), each MoE matrix kind's experts are packed
    back to back as one stack, which the staged layer runs as one routed call per kind: the resident tokens."""
    from llada_jax.model.params import block_from_stage
    from llada_jax.quant.qlinear import unpack_stage
    from llada_jax.weights.loading import stage_on_device

    config, checkpoint = int4_llada2(tmp_path)
    resident = llada_jax.load(checkpoint, dtype="float32", activations=activations)
    staged = llada_jax.load(checkpoint, dtype="float32", activations=activations,
                            device_memory_budget=resident.weight_bytes - 1)
    assert staged.staged is not None
    entries = {name: shape for name, shape, *_ in staged.staged.layouts[config.dense_layers].entries}
    assert entries["experts_down.values"] == (config.n_experts, config.d_model, config.mlp_hidden_size // 2)
    assert not any("." in name.removesuffix(".values").removesuffix(".scale") for name in entries)  # no expert's own
    layer = block_from_stage(unpack_stage(stage_on_device(staged.staged, config.dense_layers),
                                          staged.staged.quantization[config.dense_layers]))
    assert all(layer[key].kernel and layer[key].values.shape[0] == config.n_experts for key in moe.EXPERT_KEYS)
    _assert_same_tokens(functools.partial(llada_jax.generate, staged), functools.partial(llada_jax.generate, resident))


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["int8", "float"])
@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_an_int4_bundle_runs_the_routed_kernels_and_gives_the_xla_tokens(tmp_path, activations, streamed):
    """Resident in the bundle's archive (`lowering.bundle_weights.with_stacked_experts`) or streamed
    (`lowering.stage_ring.Piece`), the experts come stacked: with our kernels each matrix kind of a layer is one
    routed call, no loop over experts; XLA's own loop per expert, through the same kernels, gives the same tokens."""
    config, checkpoint = int4_llada2(tmp_path)
    with mock.patch.object(moe.own_kernels, "routed_matmul", wraps=own_kernels.routed_matmul) as routed_calls:
        bundle = _bundle(checkpoint, config, tmp_path / "bundle", streamed, activations=activations)
    assert routed_calls.call_count >= 3 * (config.n_layers - config.dense_layers)  # per step: each MoE layer's 3
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert bool(manifest["streamed"]) == streamed and manifest["kernels"]["kind"] == "own"
    _assert_xla_tokens(bundle, llada_jax.load(checkpoint, activations=activations))


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_stacked_int4_experts_on_iree_code_are_declared_as_bytes_and_give_the_xla_tokens(tmp_path, streamed):
    """Without our kernels, stacked 4-bit experts are declared as their bytes, two values each: IREE 3.13 fails to
    compile an expert sliced out of an int4 stack. The LM head is int8 (a 4-bit head of this tiny model's width
    fails in IREE's own code, stacked or not)."""
    from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
    from lowering.bundle_weights import expert_stack

    config, _ = int4_llada2(tmp_path)
    checkpoint = quantize_checkpoint(tmp_path / "model", tmp_path / "int4-int8-head", QuantScheme(4, 32))
    bundle = _bundle(checkpoint, config, tmp_path / "bundle", streamed, kernels="compiler")
    parameters = json.loads((bundle / "manifest.json").read_text())["parameters"]
    kind = ".experts_gate.weight_packed"
    gates = [p for p in parameters if (expert_stack(p["name"], config) or p["name"]).endswith(kind)]
    expert = [config.mlp_hidden_size, config.d_model // 2]  # bytes
    if streamed:  # each expert its parameter, the ring stacks them
        assert {(tuple(p["shape"]), p["dtype"]) for p in gates} == {(tuple(expert), "int8")}
    else:
        assert [(p["shape"], p["dtype"]) for p in gates] == [([config.n_experts, *expert], "int8")] * (
            config.n_layers - config.dense_layers)
    _assert_xla_tokens(bundle, llada_jax.load(checkpoint, kernels="compiler"))


def _bundle(checkpoint, config, out, streamed: bool, **options):
    from lowering.bundle import compile_bundle

    budget = bundle_weight_bytes(checkpoint) - 1 if streamed else None
    return compile_bundle(checkpoint, "host", out, max_len=32, window=32, block_length=8,
                          device_memory_budget=budget, **options)


def _assert_xla_tokens(bundle, model) -> None:
    from llada_jax.bundle_runner import bundle_runner

    _assert_same_tokens(bundle_runner(bundle)[2], functools.partial(llada_jax.generate, model), policy="dual-cache",
                        loop="host")


def _assert_same_tokens(generate, reference, **settings) -> None:
    """Both generate functions give the same answer to one prompt, without and with 2.1's editing."""
    for editing in (None, 0.3):
        options = dict(gen_length=12, block_length=8, steps=4, threshold=0.3, editing_threshold=editing, **settings)
        assert (generate(np.arange(1, 7), **options).output_ids.tolist()
                == reference(np.arange(1, 7), **options).output_ids.tolist())


@pytest.mark.slow
def test_an_moe_bundle_on_our_routed_kernels_carries_the_decode_loop(tmp_path, capsys):
    """LLaDA-MoE, int4, its experts stacked on our routed kernels: the compiled decode loops and `run.sh` give the
    host loop's tokens (the routing groups pairs by expert with no sort: IREE 3.13's argsort in the loop misplaced
    some). Its experts in loops (a float checkpoint), or its weights streamed under a budget, the loop is refused
    in one line."""
    from llada_jax.bundle_runner import bundle_runner
    from llada_jax.cli import main
    from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
    from lowering.bundle import compile_bundle
    from lowering.export import canvas_sizes
    from policies.compiled_loop import baked_loops
    from tests.test_decode_loop_bundle import host_iree_run_module, run_script
    from tests.test_families import LLADA_CONVENTIONS, MOE

    if own_kernels.available() is None:
        pytest.skip("no C compiler for our kernels")
    config = dataclasses.replace(MOE, mlp_hidden_size=32)
    source = write_checkpoint(tmp_path / "model", config, std=0.3)
    checkpoint = quantize_checkpoint(source, tmp_path / "int4", QuantScheme(4, 32))
    settings = [("vanilla", 8), ("dual-cache", 4)]
    loops = tuple(baked_loops(policy, None, 8, 8, steps, canvas_sizes(16)) for policy, steps in settings)
    bundle = compile_bundle(checkpoint, "host", tmp_path / "bundle", max_len=16, window=16, loops=loops)
    generate_bundled = bundle_runner(bundle)[2]
    model = llada_jax.load(checkpoint)
    for prompt in (np.arange(1, 7), np.array([9, 200, 31])):
        for policy, steps in settings:
            options = dict(gen_length=8, block_length=8, steps=steps, policy=policy, **LLADA_CONVENTIONS)
            host = llada_jax.generate(model, prompt, **options).output_ids.tolist()
            compiled = generate_bundled(prompt, loop="compiled", **options)
            assert compiled.stats["loop"] == "compiled" and compiled.output_ids.tolist() == host
            if policy == settings[0][0]:  # run.sh runs the first setting
                proc = run_script(bundle, ",".join(map(str, prompt)), str(host_iree_run_module()))
                assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == ",".join(map(str, host))
    common = ["--target", "host", "--max-len", "16", "--gen-length", "8", "--block-length", "8"]
    assert main(["compile", "--model", str(source), "--out", str(tmp_path / "float"), *common]) == 1
    assert "carries steps only (compile with --no-loop)" in capsys.readouterr().err
    budget = str(bundle_weight_bytes(checkpoint) - 1)  # streamed: IREE 3.13 fails on the loop
    assert main(["compile", "--model", str(checkpoint), "--out", str(tmp_path / "streamed"), *common,
                 "--device-memory-budget", budget]) == 1
    error = capsys.readouterr().err.strip()
    assert "and resident" in error and len(error.splitlines()) == 1 and not (tmp_path / "streamed").exists()
