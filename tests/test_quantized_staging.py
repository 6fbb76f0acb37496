"""Staged execution of quantized checkpoints: stages keep the integers packed as stored (4-8x fewer bytes to
stream than float32), the pieces rebuild them exactly, and a staged generation equals the resident one."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.quant.qlinear import split_nibbles, unpack_stage
from llada_jax.quant.quantize import HostQuantized, QuantScheme, quantize_matrix
from llada_jax.staging.packing import layer_layout
from llada_jax.staging.swap import _pack_stage, kv_bytes
from llada_jax.weights.quant_config import EDGE_SCHEME
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
from tests.conftest import TINY, write_checkpoint
from tests.test_staging import check_staged_bytes

# label -> (scheme of the decoder layers, activations)
CASES = {"int4-g16": (QuantScheme(4, 16), "float"), "int8": (QuantScheme(8), "float"), "w8a8": (QuantScheme(8), "int8")}
POLICIES = ["vanilla", "dual-cache", "dual-cache+speculative:1:0.3+revision:0.5"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """label -> (checkpoint dir, the resident model)."""
    root = tmp_path_factory.mktemp("qstaged")
    source = write_checkpoint(root / "src")
    out = {}
    for label, (scheme, activations) in CASES.items():
        head = scheme if scheme.bits == 4 else EDGE_SCHEME  # int4: the LM head group-wise too
        checkpoint = quantize_checkpoint(source, root / label, scheme, shard_bytes=20_000, head=head)
        out[label] = (checkpoint, llada_jax.load(checkpoint, activations=activations))
    return out


@settings(max_examples=12)
@given(label=st.sampled_from(list(CASES)), fraction=st.floats(0.0, 1.0), policy=st.sampled_from(POLICIES),
       seed=st.integers(0, 500), threshold=st.sampled_from([None, 0.3]))
@pytest.mark.slow
def test_quantized_staged_equals_quantized_resident(models, label, fraction, policy, seed, threshold):
    checkpoint, resident = models[label]
    probe = llada_jax.load(checkpoint, device_memory_budget=1, activations=CASES[label][1])
    minimum = probe.staged.buffer_bytes + kv_bytes(TINY, 2, 32, 4)  # one staging buffer beside the KV state
    assert minimum < resident.weight_bytes
    budget = minimum + int(fraction * (resident.weight_bytes - 1 - minimum))
    staged = llada_jax.load(checkpoint, device_memory_budget=budget, activations=CASES[label][1])
    assert staged.staged is not None and staged.params is None
    prompt = np.random.default_rng(seed).integers(0, TINY.mask_token_id, 6)
    options = dict(gen_length=16, block_length=8, steps=8, policy=policy, threshold=threshold)
    want, got = llada_jax.generate(resident, prompt, **options), llada_jax.generate(staged, prompt, **options)
    assert got.output_ids.tolist() == want.output_ids.tolist() and got.nfe == want.nfe
    check_staged_bytes(got.stats, staged.staged.stages, got.nfe)
    ids = np.random.default_rng(seed).integers(0, TINY.vocab_size, (2, 20))
    expected = np.asarray(llada_jax.logits(resident, ids))
    # W8A8 rounds each position's activations to int8: a float rounding difference between the staged and
    # the whole-model program can move one value across a rounding boundary (seen: 0.038 of logits up to ~5).
    tolerance = 2e-2 if CASES[label][1] == "int8" else 1e-5
    np.testing.assert_allclose(llada_jax.logits(staged, ids), expected, atol=tolerance * np.abs(expected).max(),
                               rtol=0)


def test_quantized_stages_stream_fewer_bytes(models, tiny_dir):
    """Stage bytes: integers at bits/8 bytes a value plus the scales as stored (bfloat16: 2 bytes), against 4
    bytes a value."""
    float_stages = llada_jax.load(tiny_dir, device_memory_budget=1).staged
    for label, (scheme, activations) in CASES.items():
        stages = llada_jax.load(models[label][0], device_memory_budget=1, activations=activations).staged
        layer, float_layer = stages.layers[0].nbytes, float_stages.layers[0].nbytes
        matrices = sum(int(np.prod(shape)) for name, shape, _ in layer_layout(TINY).entries if len(shape) == 2)
        scales = sum(shape[0] * scheme.groups(shape[1]) for name, shape, _ in layer_layout(TINY).entries
                     if len(shape) == 2)
        assert matrices * scheme.bits // 8 + 2 * scales <= layer < 0.45 * float_layer
        scale_dtypes = {dtype for name, _, dtype, _ in stages.layouts[0].entries if name.endswith(".scale")}
        assert scale_dtypes == {np.dtype(ml_dtypes.bfloat16)}
        assert stages.quantization[0] and all(bits == scheme.bits for _, bits, *_ in stages.quantization[0])


def stored_integers(weight) -> np.ndarray:
    if not weight.nibbles:
        return np.asarray(weight.values).astype(np.int8)
    low, high = (np.asarray(half) for half in split_nibbles(weight.values, weight.offset))
    return np.stack([low, high], axis=-1).reshape(weight.shape)


@settings(max_examples=30)
@given(bits=st.sampled_from([4, 8]), group=st.sampled_from([None, 8, 16]), rows=st.integers(1, 9),
       columns=st.sampled_from([16, 32, 48]), seed=st.integers(0, 1000), activations=st.sampled_from(["float", "int8"]),
       scale_dtype=st.sampled_from([np.float32, ml_dtypes.bfloat16]))
def test_packed_stage_rebuilds_the_integers_exactly(bits, group, rows, columns, seed, activations, scale_dtype):
    """The integers and the scales come back exactly, the scales in the dtype they were stored in."""
    scheme = QuantScheme(bits, group)
    w = np.random.default_rng(seed).normal(size=(rows, columns)).astype(np.float32)
    values, scale = quantize_matrix(w, scheme)
    host = HostQuantized.of(values, scale.astype(scale_dtype), scheme)
    norm = np.random.default_rng(seed + 1).normal(size=(columns,)).astype(np.float32)
    packed, layout, quantization = _pack_stage({"m": host, "norm": norm}, _Layout(rows, columns), np.float32,
                                               activations)
    views = {name: jax.device_put(view) for name, view in layout.views(packed).items()}
    rebuilt = unpack_stage(views, quantization)
    assert rebuilt["m"].nibbles == (bits == 4) and rebuilt["m"].shape == host.shape
    assert np.array_equal(stored_integers(rebuilt["m"]), host.values)
    assert rebuilt["m"].scale.dtype == scale_dtype and np.array_equal(np.asarray(rebuilt["m"].scale), host.scale)
    assert np.array_equal(np.asarray(rebuilt["norm"]), norm)
    per_channel_int8 = bits == 8 and group is None
    assert rebuilt["m"].activations == (activations if per_channel_int8 else "float")


class _Layout:
    """A two-tensor stage layout (a matrix and a norm) in the shape of `packing.PackedLayout`."""

    def __init__(self, rows: int, columns: int):
        self.entries = (("m", (rows, columns), 0), ("norm", (columns,), 0))
