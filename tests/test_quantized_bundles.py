"""Quantized IREE bundles: a compressed-tensors checkpoint bound as it is stored (int4 / int8 parameters whose
offset the step undoes) decodes exactly as XLA does on the same checkpoint, for every decoder; W8A8 baked in;
phone targets compile; what cannot work is refused in one line before iree-compile runs."""

from __future__ import annotations

import json
from pathlib import Path

import iree.runtime as rt
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

import llada_jax
from llada_jax.backends.iree import IreeBackend, Session, load_bundle
from llada_jax.backends.select import OpenBundle
from llada_jax.bundle_runner import generate_with_bundle
from llada_jax.model.readout import ReadoutSpec, TokenBiases
from llada_jax.quant import qlinear
from llada_jax.quant.qlinear import row_block_for
from llada_jax.quant.quantize import QuantScheme
from llada_jax.system.errors import LladaError
from llada_jax.weights.quant_config import EDGE_SCHEME
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
from lowering import bundle as bundle_mod
from lowering.bundle import compile_bundle
from lowering.bundle_weights import _quantized_parameters
from tests.conftest import TINY, jax_backend, write_checkpoint
from tests.test_lowering import assert_close, random_canvas

pytestmark = pytest.mark.slow  # IREE compiles or child processes: the full tier only

# (label, scheme of the decoder layers, activations): group-wise int4 (the LM head too) with float activations,
# and per-channel int8 as W8A8. The embedding is int8 per row in both, the W8A8 head too (`EDGE_SCHEME`). Our
# kernels run groups of 32 (W4A16, W4A8) and W8A8 on both sides; groups of 16 are IREE's and XLA's own code.
CASES = [("int4-g16", QuantScheme(4, 16), "float"), ("w8a8", QuantScheme(8), "int8"),
         ("int4-g32", QuantScheme(4, 32), "float"), ("w4a8", QuantScheme(4, 32), "int8")]
ACTIVATIONS = {label: activations for label, _, activations in CASES}
POLICIES = ["vanilla", "prefix-cache", "dual-cache", "dual-cache+speculative:1:0.3",
            "dual-cache+speculative+revision:0.4"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qsrc") / "src")


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory) -> dict:
    """label -> (checkpoint dir, XLA model, opened host bundle)."""
    root = tmp_path_factory.mktemp("qbundles")
    out = {}
    for label, scheme, activations in CASES:
        head = scheme if scheme.bits == 4 else EDGE_SCHEME
        checkpoint = quantize_checkpoint(source, root / label, scheme, shard_bytes=20_000, head=head)
        path = compile_bundle(checkpoint, "host", root / f"{label}-bundle", max_len=32, window=32,
                              activations=activations)
        bundle = load_bundle(path, "host")
        opened = OpenBundle(bundle, Session(bundle.path, bundle.manifest, "local-task"))
        out[label] = (checkpoint, llada_jax.load(checkpoint, activations=activations), opened)
    return out


@settings(max_examples=16)
@given(label=st.sampled_from([c[0] for c in CASES]), policy=st.sampled_from(POLICIES),
       threshold=st.sampled_from([None, 0.3]), length=st.integers(1, 14), seed=st.integers(0, 10_000))
@example(label="w8a8", policy="vanilla", threshold=0.3, length=11, seed=4360)  # parts at a confidence of 0.3019
def test_quantized_bundle_decodes_as_xla(quantized, label, policy, threshold, length, seed):
    _, model, opened = quantized[label]
    prompt = np.random.default_rng(seed).integers(0, TINY.mask_token_id, length)
    options = dict(gen_length=16, block_length=8, steps=8, policy=policy, threshold=threshold)
    want = llada_jax.generate(model, prompt, **options)
    got = generate_with_bundle(opened, prompt, **options)
    parted = first_divergence(got.trace, want.trace)
    if ACTIVATIONS[label] == "int8" and parted is not None:
        assert_divergence_on_a_boundary(*parted, threshold)
        return
    assert got.output_ids.tolist() == want.output_ids.tolist() and got.nfe == want.nfe
    assert [r.revisions for r in got.trace] == [r.revisions for r in want.trace]


# W8A8: how far the two compilers' confidences may sit apart (an int8 rounding flip moved one logp by 0.02).
FLIP = 0.02


def first_divergence(got, want):
    """The first pass at which the two traces commit different positions or tokens, as (got's, want's)."""
    return next(((mine, theirs) for mine, theirs in zip(got, want)
                 if (mine.positions, mine.tokens) != (theirs.positions, theirs.tokens)), None)


def assert_divergence_on_a_boundary(mine, theirs, threshold) -> None:
    """W8A8 decodes may part where a decision sits on a boundary (`assert_close_up_to_int8_flips`): every
    position committed by one side only has a confidence within FLIP of a cutoff (the threshold, or the
    least confidence the other side committed), and a position committed with different tokens is a near
    tie (the two confidences within FLIP). Seen: a confidence of 0.3019 against a threshold of 0.3."""
    a, b = (dict(zip(step.positions, zip(step.tokens, step.confidence))) for step in (mine, theirs))
    for position in a.keys() | b.keys():
        if position in a and position in b:
            assert abs(a[position][1] - b[position][1]) <= FLIP
            continue
        side, other = (a, b) if position in a else (b, a)
        cutoffs = ([threshold] if threshold is not None else []) + [min((c for _, c in other.values()), default=1.0)]
        assert min(abs(side[position][1] - cutoff) for cutoff in cutoffs) <= FLIP


def assert_close_up_to_int8_flips(got, want, activations: str) -> None:
    """Float activations: float32 agreement. W8A8 rounds every activation to int8 per token, and the two
    compilers' float32 sums differ in their last bits: where a value sits on a rounding boundary it lands one
    step of the int8 grid apart, and that token's outputs move (seen: one logp of 21 by 0.02, the rest within
    1e-6; XLA alone moves the same logp as much when attention's einsums are ordered differently). So: every
    value within 1% of the scale, and at most one in ten beyond float32 agreement."""
    if activations == "float":
        assert_close(got, want)
    else:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        apart = np.abs(got - want) / max(1.0, np.abs(want).max())
        assert apart.max() <= 1e-2 and np.mean(apart > 1e-4) <= 0.1


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_quantized_full_step_matches_xla(quantized, label):
    _, model, opened = quantized[label]
    activations = {name: acts for name, _, acts in CASES}[label]
    iree = IreeBackend(opened.bundle, opened.session, ReadoutSpec(), TokenBiases.build(TINY.embedding_size))
    for seed, (slots, length) in enumerate([(8, 5), (16, 16), (32, 21)]):
        tokens, valid = random_canvas(seed, slots, length)
        want, got = jax_backend(model).full(tokens, valid), iree.full(tokens, valid)
        assert got.readout.x0[:, :length].tolist() == want.readout.x0[:, :length].tolist()
        assert_close_up_to_int8_flips(got.readout.logp[:, :length], want.readout.logp[:, :length], activations)
        assert_close_up_to_int8_flips(opened.session.read(got.keys)[:, :, :length],
                                      np.asarray(want.keys)[:, :, :length], activations)


def test_our_kernels_run_what_they_take_and_the_manifest_says_so(quantized):
    """Groups of 32 run our kernels (W4A16 and W4A8, and W8A8) in the bundle as in the XLA model: the packed
    parameters are declared as the bytes they are stored as and kept offset in the archive; groups of 16 run
    IREE's code."""
    kinds = {label: quantized[label][2].bundle.manifest["kernels"] for label in ACTIVATIONS}
    assert kinds["int4-g16"] == {"kind": "compiler"}
    layers = 2 * 7  # q k v o, ff gate/up/down per layer
    assert kinds["int4-g32"]["kind"] == "own" and kinds["int4-g32"]["matrices"] == {"w4a16": layers + 1}
    assert kinds["w4a8"]["matrices"] == {"w4a8": layers + 1}
    assert kinds["w8a8"]["matrices"] == {"w8a8": layers + 1}  # the int8 head too
    checkpoint, model, opened = quantized["int4-g32"]
    q_proj = "model.transformer.blocks.0.q_proj"
    parameters = {p["name"]: p for p in opened.bundle.manifest["parameters"]}
    assert parameters[q_proj + ".weight_packed"]["shape"] == [32, 16] and model.kernels == "own"
    archive = rt.ParameterIndex()
    archive.load(str(opened.bundle.path / "weights.irpa"))
    stored = {name: array for file in checkpoint.glob("*.safetensors") for name, array in load_file(file).items()}
    entry = next(entry for name, entry in archive.items() if name == q_proj + ".weight_packed")
    assert bytes(entry.file_view) == stored[q_proj + ".weight_packed"].tobytes()


def test_quantized_manifest_binds_the_checkpoint_as_stored(quantized):
    checkpoint, _, opened = quantized["int4-g16"]
    manifest = opened.bundle.manifest
    parameters = {p["name"]: p for p in manifest["parameters"]}
    q_proj = "model.transformer.blocks.0.q_proj"
    assert parameters[q_proj + ".weight_packed"] == {"name": q_proj + ".weight_packed", "shape": [32, 32],
                                                     "dtype": "int4"}
    assert parameters[q_proj + ".weight_scale"]["dtype"] == "bfloat16"
    assert parameters["model.transformer.ff_out.weight_packed"]["dtype"] == "int4"
    assert parameters["model.transformer.wte.weight_packed"]["dtype"] == "int8"
    assert "model.transformer.blocks.0.attn_norm.weight" in parameters and q_proj + ".weight" not in parameters
    assert manifest["model_config"]["quantization_config"] == json.loads(
        (checkpoint / "config.json").read_text())["quantization_config"]
    assert manifest["weights"] == {"files": ["weights.irpa"], "copied": True}  # a CPU bundle's archive
    archive = rt.ParameterIndex()
    archive.load(str(opened.bundle.path / "weights.irpa"))
    entries = {name: bytes(entry.file_view) for name, entry in archive.items()}
    stored = {name: array for file in checkpoint.glob("*.safetensors") for name, array in load_file(file).items()}
    assert entries.keys() == stored.keys()
    for name, array in stored.items():
        bits = {"int4": 4, "int8": 8}.get(parameters.get(name, {}).get("dtype"))
        if bits is None:  # float tensors (and the shape records) byte for byte
            assert entries[name] == array.tobytes(), name
        else:  # packed integers signed: each value is the stored one less its offset
            assert (unpack(entries[name], bits, signed=True) == unpack(array.tobytes(), bits) - (1 << bits - 1)).all()


def unpack(data: bytes, bits: int, signed: bool = False) -> np.ndarray:
    """Packed values, low bits first: two's complement when `signed`, else unsigned."""
    raw = np.frombuffer(data, np.uint8)
    values = raw.astype(np.int16) if bits == 8 else np.stack([raw & 0xF, raw >> 4], -1).reshape(-1).astype(np.int16)
    return np.where(values >= 1 << bits - 1, values - (1 << bits), values) if signed else values


def captured_modules(monkeypatch) -> list[str]:
    """The StableHLO text of every module compile_bundle hands to iree-compile, in order."""
    texts = []
    compile_module = bundle_mod.compile_module
    monkeypatch.setattr(bundle_mod, "compile_module", lambda text, *a: texts.append(text) or compile_module(text, *a))
    return texts


def test_quantized_android_bundle_compiles(quantized, tmp_path, monkeypatch):
    """Group-wise int4 reaches iree-compile without XLA's hoisting barrier: with it, LLaDA-8B's 32-layer
    decode loop failed to compile ("failed to solve for timepoint coverage")."""
    checkpoint = quantized["int4-g16"][0]
    texts = captured_modules(monkeypatch)
    path = compile_bundle(checkpoint, "android-arm64", tmp_path / "arm64", max_len=8, window=8)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["target"] == "android-arm64" and (path / "steps.vmfb").stat().st_size > 10_000
    barriers = [line for text in texts for line in text.splitlines() if "optimization_barrier" in line]
    assert texts and not [line for line in barriers if "xi4>" in line], barriers[:1]


def test_a_head_in_row_blocks_decodes_as_xla(quantized, tmp_path, monkeypatch):
    """IREE bundles dequantize a big matrix in row blocks too (LLaDA-8B's 4-bit head: a 2.07 GB float copy
    at once, and the step's NaN on IREE's CPU backend). Forced small here: the head's 512 rows in 16
    blocks, the MLP matrices in 2; the unsplit XLA model decodes the same tokens."""
    checkpoint, model, _ = quantized["int4-g16"]
    monkeypatch.setattr(qlinear, "FLOAT_COPY_BYTES", 4096)
    assert row_block_for((TINY.embedding_size, TINY.d_model)) == 32
    texts = captured_modules(monkeypatch)
    bundle = load_bundle(compile_bundle(checkpoint, "host", tmp_path / "blocks", max_len=32, window=32), "host")
    assert "(tensor<512x32xi4>) -> tensor<32x32xi4>" in texts[0]  # a block of the head's rows (signed in the archive)
    assert_decodes_as_xla(bundle, model)


@pytest.mark.parametrize("label, activations", [(label, acts) for label, _, acts in CASES])
def test_a_bundle_linking_the_checkpoint_decodes_as_xla(quantized, tmp_path, label, activations):
    """Linked weights stay the checkpoint's offset integers (float activations: read unsigned, the offset
    undone in float; int8 activations: signed again in the step)."""
    checkpoint, model, _ = quantized[label]
    bundle = load_bundle(compile_bundle(checkpoint, "host", tmp_path / "linked", max_len=32, window=32,
                                        copy_weights=False, activations=activations), "host")
    assert bundle.manifest["weights"]["copied"] is False
    assert_decodes_as_xla(bundle, model)


def assert_decodes_as_xla(bundle, model) -> None:
    """Two prompts and decoders through the bundle give the XLA model's tokens."""
    opened = OpenBundle(bundle, Session(bundle.path, bundle.manifest, "local-task"))
    for seed, policy in enumerate(["vanilla", "dual-cache+speculative:1:0.3"]):
        prompt = np.random.default_rng(seed).integers(0, TINY.mask_token_id, 6 + seed)
        options = dict(gen_length=16, block_length=8, steps=8, policy=policy)
        want = llada_jax.generate(model, prompt, **options)
        assert generate_with_bundle(opened, prompt, **options).output_ids.tolist() == want.output_ids.tolist()


def one_line(call, fragment: str) -> None:
    with pytest.raises(LladaError) as err:
        call()
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_what_a_quantized_bundle_cannot_do_is_refused_before_compiling(quantized, tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_mod, "compile_module", lambda *a: pytest.fail("iree-compile was called"))
    int4 = quantized["int4-g16"][0]
    one_line(lambda: compile_bundle(int4, "host", tmp_path / "a", max_len=8, window=8, device_memory_budget=1000),
             "is too small for this model: streaming its weights needs")
    one_line(lambda: compile_bundle(int4, "host", tmp_path / "b", max_len=8, window=8, activations="int8",
                                    kernels="compiler"),
             "--activations int8 on 4-bit or group-wise layers needs our kernels")
    one_line(lambda: compile_bundle(int4, "host", tmp_path / "b", max_len=8, window=8, activations="int8"),
             "groups of 16 (requantize with --group-size 32)")
    stored = {"m.weight_packed": ("I32", (4, 1)), "m.weight_scale": ("BF16", (4, 1))}
    one_line(lambda: _quantized_parameters("m", (4, 12), QuantScheme(4), stored, tmp_path),
             "fill whole int32 words (a multiple of 8)")
    stored = {"m.weight_packed": ("I64", (4, 2)), "m.weight_scale": ("BF16", (4, 1))}
    one_line(lambda: _quantized_parameters("m", (4, 16), QuantScheme(4), stored, tmp_path),
             "m.weight_packed must be I32 [4, 2], got I64 [4, 2]")
