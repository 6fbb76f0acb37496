"""Quantized weights: the packing format, the quantization bound, the quantized matmuls against plain ones,
the checkpoint written and read back (same tokens as its dequantized float twin), one-line errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from unittest import mock

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import llada_jax
from llada_jax.cli import main
from llada_jax.model.config import read_config
from llada_jax.model.params import hf_shapes, hf_to_params
from llada_jax.quant import qlinear
from llada_jax.quant.qlinear import QuantizedWeight, quantized_linear, quantized_rows, row_block_for, to_device
from llada_jax.quant.quantize import HostQuantized, QuantScheme, dequantize, pack_int32, quantize_matrix, unpack_int32
from llada_jax.system.errors import LladaError
from llada_jax.weights.checkpoint import save_hf
from llada_jax.weights.quant_config import EDGE_SCHEME, planned_modules, quantization_config, quantized_modules
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
from llada_jax.weights.safetensors_file import SafetensorsFile
from llada_jax.weights.weights_io import iter_tensors
from tests.conftest import TINY, in_mapped_file, write_checkpoint
from tests.test_checkpoint import edit_json, raw_tensors

SCHEMES = {"int8": QuantScheme(8), "int4-g16": QuantScheme(4, 16)}  # 16 divides d_model 32 and mlp 64
QUANT_SCHEMES = [QuantScheme(8), QuantScheme(4), QuantScheme(8, 4), QuantScheme(4, 4), QuantScheme(4, 8)]


def reference_pack(q: np.ndarray, bits: int) -> list[list[int]]:
    """Python-int packing straight from the format's wording: offset, first value lowest, zero padding."""
    per_word = 32 // bits
    out = []
    for row in q.tolist():
        words = []
        for start in range(0, len(row), per_word):
            word = sum((v + (1 << (bits - 1))) << (bits * k) for k, v in enumerate(row[start: start + per_word]))
            words.append(word - (1 << 32) if word >= 1 << 31 else word)
        out.append(words)
    return out


@settings(max_examples=25)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 3), columns=st.integers(1, 37), data=st.data())
def test_pack_unpack_round_trip_and_layout(bits, rows, columns, data):
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = data.draw(hnp.arrays(np.int8, (rows, columns), elements=st.integers(low, high)))
    packed = pack_int32(q, bits)
    assert packed.dtype == np.int32 and packed.shape == (rows, -(-columns * bits // 32))
    assert packed.tolist() == reference_pack(q, bits)
    unpacked = unpack_int32(packed, bits, columns)
    assert unpacked.dtype == np.int8 and np.array_equal(unpacked, q)


@settings(max_examples=25)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 3), columns=st.integers(1, 37), start=st.integers(0, 3),
       count=st.integers(1, 5), data=st.data())
def test_signed_bytes_and_row_slices_hold_the_values(bits, rows, columns, start, count, data):
    """The words' bytes less the offset are the values (8 bits) or their signed nibbles, low first (4 bits);
    a row slice past the end is zero rows."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = data.draw(hnp.arrays(np.int8, (rows, columns), elements=st.integers(low, high)))
    host = HostQuantized.of(q, np.ones((rows, 1), np.float32), QuantScheme(bits))
    signed = host.signed_bytes().view(np.int8)
    if bits == 8:
        unpacked = signed[:, :columns]
    else:
        nibbles = np.stack([(signed << 4) >> 4, signed >> 4], axis=-1).reshape(rows, -1)
        unpacked = nibbles[:, :columns]
    assert np.array_equal(unpacked, q)
    part = host.rows(start, count)
    want = np.concatenate([q, np.zeros((start + count, columns), np.int8)])[start: start + count]
    inside = min(count, max(rows - start, 0))
    assert np.array_equal(part.values, want) and part.scale[:, 0].tolist() == [1.0] * inside + [0.0] * (count - inside)


@pytest.mark.parametrize("bits, values, words", [
    (8, [1, 2], [33409]),                        # 129 + 130 * 256: the compressed-tensors example
    (8, [-128, -128, -128, 127], [-16777216]),   # 255 << 24 as a signed int32
    (4, [-8, 7, 0, 1], [39152]),                 # 0 | 15 << 4 | 8 << 8 | 9 << 12
    (4, [7] * 8 + [-8], [-1, 0]),                # a full word of 15s; the padding of the last word is 0
])
def test_known_packed_words(bits, values, words):
    q = np.asarray([values], np.int8)
    assert pack_int32(q, bits).tolist() == [words]
    assert unpack_int32(np.asarray([words], np.int32), bits, len(values)).tolist() == [values]


# Magnitudes far from float32's subnormal range (see test_tiny_nonzero_group_gets_a_usable_scale).
WEIGHTS = st.one_of(st.just(0.0), st.floats(2.0**-60, 1e4, width=32), st.floats(-1e4, -2.0**-60, width=32))


@settings(max_examples=25)
@given(scheme=st.sampled_from(QUANT_SCHEMES), rows=st.integers(1, 4), groups=st.integers(1, 3), data=st.data())
def test_quantize_matrix_error_is_at_most_half_a_step(scheme, rows, groups, data):
    columns = groups * (scheme.group_size or data.draw(st.integers(1, 9)))
    w = data.draw(hnp.arrays(np.float32, (rows, columns), elements=WEIGHTS))
    w[data.draw(st.integers(0, rows - 1))] = 0.0  # one all-zero row, always
    q, scale = quantize_matrix(w, scheme)
    n_groups = 1 if scheme.group_size is None else groups
    assert q.dtype == np.int8 and q.shape == w.shape and np.abs(q).max() <= scheme.qmax
    assert scale.dtype == np.float32 and scale.shape == (rows, n_groups)
    assert np.array_equal(scale.astype(ml_dtypes.bfloat16).astype(np.float32), scale)
    step = np.repeat(scale, columns // n_groups, axis=1)
    error = np.abs(w.astype(np.float64) - dequantize(q, scale))
    assert np.all(error <= step / 2 + 1e-6 * np.abs(w))  # slack: the float32 division w / scale
    zero_groups = np.all(w.reshape(rows, n_groups, -1) == 0, axis=-1)
    assert np.all(scale[zero_groups] == 1.0) and np.all(q[np.all(w == 0, axis=1)] == 0)


def test_scheme_and_group_errors():
    with pytest.raises(LladaError, match="group size 16 does not divide a matrix's 24 input columns"):
        quantize_matrix(np.ones((2, 24), np.float32), QuantScheme(4, 16))
    with pytest.raises(LladaError, match="bits must be one of 4, 8, got 3"):
        QuantScheme(3)
    with pytest.raises(LladaError, match="positive integer, got 0"):
        QuantScheme(4, 0)


@pytest.mark.parametrize("bits, absmax", [(8, 5e-39), (4, 3e-40), (8, 1.4519498658786282e-36)])
def test_tiny_nonzero_group_gets_a_usable_scale(bits, absmax):
    w = np.asarray([[absmax, absmax / 3]], np.float32)
    with np.errstate(all="ignore"):
        q, scale = quantize_matrix(w, QuantScheme(bits))
    assert scale[0, 0] > 0 and np.all(np.abs(w - dequantize(q, scale)) <= scale[0, 0] / 2)


def random_quantized(scheme: QuantScheme, rows: int, columns: int, seed: int) -> HostQuantized:
    w = np.random.default_rng(seed).normal(0, 1, (rows, columns)).astype(np.float32)
    return HostQuantized.of(*quantize_matrix(w, scheme), scheme)


@settings(max_examples=15)
@given(scheme=st.sampled_from(QUANT_SCHEMES), batch=st.integers(1, 2), width=st.integers(1, 5),
       rows=st.integers(1, 6), groups=st.integers(1, 3), odd=st.booleans(), seed=st.integers(0, 2**16),
       copy_rows=st.integers(1, 7))
@pytest.mark.slow
def test_float_activation_matmul_equals_dequantized_matmul(scheme, batch, width, rows, groups, odd, seed, copy_rows):
    """`copy_rows`: rows per float copy (below `rows`, the matmul runs in row blocks: in a loop on XLA, unrolled
    in IREE bundles). `odd`: a per-channel matrix of odd width (4-bit: not split in byte pairs)."""
    columns = groups * (scheme.group_size or 8) + (odd and not scheme.group_size)
    host = random_quantized(scheme, rows, columns, seed)
    with mock.patch.object(qlinear, "LOOP_COPY_BYTES", copy_rows * host.shape[1] * 4):
        float_activation_matmul_equals_dequantized_matmul(host, batch, width, seed)
        unrolled = to_device(host, "float")
        assert unrolled.nibbles == (scheme.bits == 4 and columns % 2 == 0)
        unrolled = dataclasses.replace(unrolled, hoist_barrier=False)
        x = np.random.default_rng(seed + 1).normal(0, 2, (batch, width, host.shape[1])).astype(np.float32)
        weight = host.dequantize().astype(np.float64)
        got = np.asarray(quantized_linear(jnp.asarray(x), unrolled))
        assert np.all(np.abs(got - x @ weight.T) <= 1e-5 * (np.abs(x) @ np.abs(weight).T) + 1e-30)


def float_activation_matmul_equals_dequantized_matmul(host: HostQuantized, batch: int, width: int, seed: int):
    scheme = host.scheme
    x = np.random.default_rng(seed + 1).normal(0, 2, (batch, width, host.shape[1])).astype(np.float32)
    got = np.asarray(quantized_linear(jnp.asarray(x), to_device(host, "int8")))  # "int8" only for 8-bit channel
    weight = host.dequantize().astype(np.float64)
    bound = np.abs(x) @ np.abs(weight).T
    if scheme != QuantScheme(8):  # W8A8 is for 8-bit per-channel weights only: the others stay float
        assert to_device(host, "int8").activations == "float"
        assert got.dtype == np.float32 and np.all(np.abs(got - x @ weight.T) <= 1e-5 * bound + 1e-30)
    got = np.asarray(quantized_linear(jnp.asarray(x), to_device(host, "float")))
    assert got.dtype == np.float32 and np.all(np.abs(got - x @ weight.T) <= 1e-5 * bound + 1e-30)
    columns = x.reshape(-1, x.shape[-1]).T  # feature-major: one column per position
    got = np.asarray(quantized_linear(jnp.asarray(columns), to_device(host, "float"), columns=True))
    column_bound = bound.reshape(-1, host.shape[0]).T
    assert got.dtype == np.float32 and np.all(np.abs(got - weight @ columns) <= 1e-5 * column_bound + 1e-30)


def int8_reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W8A8 by hand: each row of x to int8 (symmetric, half-even), exact integer products, then both scales."""
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    x_scale = np.where(absmax > 0, absmax / np.float32(127), np.float32(1)).astype(np.float32)
    x_q = np.clip(np.round(x / x_scale), -127, 127).astype(np.int64)
    acc = np.einsum("bwi,oi->bwo", x_q, q.astype(np.int64))
    return acc.astype(np.float32) * x_scale * scale[:, 0]


@settings(max_examples=15)
@given(batch=st.integers(1, 2), width=st.integers(1, 5), rows=st.integers(1, 6), columns=st.integers(1, 40),
       seed=st.integers(0, 2**16), ties=st.booleans())
@pytest.mark.slow
def test_int8_activations_match_integer_reference(batch, width, rows, columns, seed, ties):
    host = random_quantized(QuantScheme(8), rows, columns, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.normal(0, 3, (batch, width, columns)).astype(np.float32)
    if ties:  # x_scale exactly 1, values on the half-integers: rounding must be half-to-even
        x = (rng.integers(-254, 255, x.shape) / 2).astype(np.float32)
        x[..., 0] = 127.0
    x[0, 0] = 0.0  # an all-zero position: scale 1, output 0
    weight = to_device(host, "int8")
    assert weight.activations == "int8"
    got = np.asarray(quantized_linear(jnp.asarray(x), weight))
    np.testing.assert_allclose(got, int8_reference(x, host.values, host.scale), rtol=1e-6, atol=0)


@settings(max_examples=10)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 20), columns=st.integers(1, 24),
       ids=st.lists(st.integers(0, 19), min_size=1, max_size=6))
@pytest.mark.slow
def test_quantized_rows_equal_dequantized_rows(bits, rows, columns, ids):
    host = random_quantized(QuantScheme(bits), rows, columns, rows * columns)
    ids = np.asarray([i % rows for i in ids])[None]
    got = np.asarray(quantized_rows(to_device(host), jnp.asarray(ids), jnp.float32))
    assert np.array_equal(got, host.dequantize()[ids])
    with pytest.raises(LladaError, match="one scale per row"):
        quantized_rows(to_device(random_quantized(QuantScheme(8, 4), 2, 8, 0)), jnp.asarray(ids * 0), jnp.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The float32 source, its quantized copies, and float32 twins written from the dequantized weights."""
    root = tmp_path_factory.mktemp("quant")
    source = write_checkpoint(root / "src")
    out = {"src": source}
    for label, scheme in SCHEMES.items():
        out[label] = quantize_checkpoint(source, root / label, scheme, shard_bytes=20_000)
        tensors = {name: value.dequantize() if isinstance(value, HostQuantized) else value
                   for name, value in iter_tensors(out[label], TINY)}
        out[label + "-float"] = save_hf(hf_to_params(tensors, TINY), TINY, root / (label + "-float"))
    return out


@pytest.mark.parametrize("label", list(SCHEMES))
def test_quantized_checkpoint_layout_and_values(checkpoints, label):
    scheme, out = SCHEMES[label], checkpoints[label]
    spec = json.loads((out / "config.json").read_text())["quantization_config"]
    assert spec == quantization_config(TINY, scheme)
    assert (spec["quant_method"], spec["format"]) == ("compressed-tensors", "pack-quantized")
    original, tensors = raw_tensors(checkpoints["src"]), raw_tensors(out)
    assert len(list(out.glob("*.safetensors"))) > 1
    for name, shape in hf_shapes(TINY).items():
        module = name[: -len(".weight")]
        if len(shape) == 1:
            assert name in tensors and tensors[name].tobytes() == original[name].tobytes()
            continue
        assert name not in tensors and tensors[f"{module}.weight_packed"].dtype == np.int32
        assert tensors[f"{module}.weight_shape"].dtype == np.int64
        assert tensors[f"{module}.weight_shape"].tolist() == list(shape)
        assert tensors[f"{module}.weight_scale"].dtype == ml_dtypes.bfloat16
    for name, value in iter_tensors(out, TINY):
        if not isinstance(value, HostQuantized):
            assert np.array_equal(value, original[name])
            continue
        module_scheme = scheme if ".blocks." in name else EDGE_SCHEME
        q, scale = quantize_matrix(original[name], module_scheme)
        assert isinstance(value, HostQuantized) and value.scheme == module_scheme
        assert np.array_equal(value.values, q) and np.array_equal(value.scale, scale)


@pytest.mark.parametrize("label", list(SCHEMES))
@pytest.mark.slow
def test_quantized_model_generates_like_its_dequantized_twin(checkpoints, label):
    quantized, twin = llada_jax.load(checkpoints[label]), llada_jax.load(checkpoints[label + "-float"])
    head, q_proj = quantized.params["lm_head"], quantized.params["blocks"][0]["q_proj"]
    # Float activations multiply the checkpoint's own offset bytes, mapped in place on a CPU device.
    assert (head.values.dtype, head.offset, head.nibbles) == (jnp.uint8, 128, False)
    assert (q_proj.values.dtype, q_proj.offset, q_proj.nibbles) == ((jnp.uint8, 128, False) if label == "int8"
                                                                   else (jnp.uint8, 8, True))
    if Path("/proc/self/maps").is_file():
        assert in_mapped_file(head.values) and in_mapped_file(q_proj.values)
    ids = np.random.default_rng(3).integers(0, 400, (2, 24))
    want = llada_jax.logits(twin, ids)
    np.testing.assert_allclose(llada_jax.logits(quantized, ids), want, atol=1e-4 * np.abs(want).max(), rtol=0)
    for policy in ("vanilla", "dual-cache"):
        for prompt in (np.arange(3, 9), np.arange(40, 52)):
            options = dict(gen_length=16, block_length=8, steps=8, policy=policy)
            got, expected = (llada_jax.generate(model, prompt, **options) for model in (quantized, twin))
            assert got.output_ids.tolist() == expected.output_ids.tolist() and got.nfe == expected.nfe


def one_line_error(call, fragment: str) -> None:
    with pytest.raises(LladaError) as err:
        call()
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_quantize_refuses_quantized_input_and_in_place_output(checkpoints, tmp_path):
    one_line_error(lambda: quantize_checkpoint(checkpoints["int8"], tmp_path / "again", QuantScheme(8)),
                   "is already quantized")
    one_line_error(lambda: quantize_checkpoint(checkpoints["src"], checkpoints["src"], QuantScheme(8)),
                   "is this command's input")
    one_line_error(lambda: quantize_checkpoint(checkpoints["src"], tmp_path / "g", QuantScheme(4, 48)),
                   "group size 48 does not divide")
    assert not (tmp_path / "again").exists() and not (tmp_path / "g").exists()


@pytest.mark.parametrize("bits, value", [(8, np.nan), (4, np.inf)])
def test_non_finite_weights_are_refused_not_quantized_into_finite_integers(tmp_path, bits, value):
    """A NaN would give its group scale 1 and integers that --check-weights can no longer see."""
    from safetensors.numpy import load_file, save_file

    source = write_checkpoint(tmp_path / "src")
    tensors = load_file(source / "model.safetensors")
    tensors["model.transformer.blocks.1.q_proj.weight"][3, 5] = value
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    one_line_error(lambda: quantize_checkpoint(source, tmp_path / "q", QuantScheme(bits, 16 if bits == 4 else None)),
                   f"cannot quantize tensor model.transformer.blocks.1.q_proj.weight: it holds a non-finite value "
                   f"({np.float32(value)}) at index [3, 5]")
    assert not (tmp_path / "q").exists()


def test_missing_scale_is_named(checkpoints, tmp_path):
    broken = shutil.copytree(checkpoints["int4-g16"], tmp_path / "broken")
    edit_json(broken / "model.safetensors.index.json",
              lambda index: index["weight_map"].pop("model.transformer.blocks.1.q_proj.weight_scale"))
    one_line_error(lambda: llada_jax.load(broken), "missing tensor model.transformer.blocks.1.q_proj.weight_scale")


def spec_with(**changes) -> dict:
    spec = quantization_config(TINY, QuantScheme(4, 16))
    spec.update({k: v for k, v in changes.items() if k == "format"})
    spec["config_groups"]["group_0"].update({k: v for k, v in changes.items() if k != "format"})
    return {"quantization_config": spec}


@pytest.mark.parametrize("spec, fragment", [
    (spec_with(format="int-quantized"), "format 'int-quantized' is not supported (only pack-quantized)"),
    (spec_with(input_activations={"num_bits": 8}), "stored activation quantization is not supported"),
    (spec_with(weights={"num_bits": 8, "strategy": "tensor"}), "weight strategy 'tensor' is not supported"),
    ({"quantization_config": {"quant_method": "gptq"}}, "only compressed-tensors checkpoints"),
    (spec_with(targets=["re:(unclosed"]), "target 're:(unclosed' is not a valid pattern"),
    (spec_with(targets=[7]), "a target must be a module name"),
    (spec_with(targets="Linear"), "targets must be a list"),
    ({"quantization_config": {**spec_with()["quantization_config"], "config_groups": [1]}},
     "config_groups must be an object"),
])
def test_unsupported_quantization_configs(spec, fragment):
    one_line_error(lambda: quantized_modules(spec, TINY), fragment)


@pytest.mark.parametrize("head", [EDGE_SCHEME, QuantScheme(4, 16)])
def test_quantization_config_reads_back_as_written(head):
    schemes = quantized_modules({"quantization_config": quantization_config(TINY, QuantScheme(4, 16), head)}, TINY)
    matrices = [name[: -len(".weight")] for name, shape in hf_shapes(TINY).items() if len(shape) == 2]
    assert sorted(schemes) == sorted(matrices) and schemes == planned_modules(TINY, QuantScheme(4, 16), head)
    assert schemes["model.transformer.ff_out"] == head and schemes["model.transformer.wte"] == EDGE_SCHEME
    assert all(s == QuantScheme(4, 16) for m, s in schemes.items() if ".blocks." in m)


def read_everything(path) -> str | None:
    """None if the file opens and every tensor reads; else the LladaError's message (other exceptions escape)."""
    try:
        with SafetensorsFile(path) as handle:
            for name in handle.entries:
                handle.read(name)
    except LladaError as err:
        return str(err)
    return None


@settings(max_examples=20)
@given(cut=st.floats(0, 1, exclude_max=True), garbage=st.binary(max_size=64))
def test_truncated_or_garbage_safetensors_is_a_one_line_error(checkpoints, tmp_path_factory, cut, garbage):
    source = sorted(checkpoints["int8"].glob("*.safetensors"))[0].read_bytes()
    path = tmp_path_factory.mktemp("bad") / "x.safetensors"
    path.write_bytes(source)
    assert read_everything(path) is None
    for content, must_fail in ((source[: int(cut * len(source))], True), (source[:8] + garbage, True),
                               (garbage, False)):  # 64 random bytes could spell a valid empty file
        path.write_bytes(content)
        message = read_everything(path)
        assert (message is not None or not must_fail) and (message is None or "\n" not in message)
        assert message is None or message.startswith(str(path))


def header_file(path, header: dict, data: bytes = bytes(4)):
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


def entry(**changes) -> dict:
    return {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], **changes}}


MALFORMED = "has a malformed header entry"


@pytest.mark.parametrize("header, fragment", [
    ([1, 2], "header is not a JSON object"),
    ({"a": "F32"}, MALFORMED),
    (entry(data_offsets=[0]), MALFORMED),
    (entry(dtype="F64"), "unsupported dtype F64"),
    (entry(shape=[2]), "byte range does not match"),
    (entry(shape=[-1, -1]), "byte range does not match"),
    (entry(dtype=["F32"]), MALFORMED),
    (entry(data_offsets=["0", "4"]), MALFORMED),
    (entry(data_offsets=[0.0, 4.0]), MALFORMED),
])
def test_malformed_headers_are_one_line_errors(tmp_path, header, fragment):
    message = read_everything(header_file(tmp_path / "x.safetensors", header))
    assert message is not None and fragment in message and "\n" not in message


def test_cli_quantize(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "--out", str(tmp_path / "x"), "--bits", "3"])
    assert exit_.value.code == 2
    out = tmp_path / "q8"
    assert main(["quantize", "--out", str(out), "--bits", "8"]) == 0
    assert f"8-bit checkpoint written to {out}" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    assert main(["quantize", "--out", str(tmp_path / "q4"), "--bits", "4"]) == 0
    assert "4-bit checkpoint written to" in capsys.readouterr().out
    groups = json.loads((tmp_path / "q4" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert groups["group_0"]["weights"]["group_size"] == 128  # the largest dividing the embedded 128 and 384
    assert main(["quantize", "--out", str(tmp_path / "q4h"), "--bits", "4", "--head-bits", "4"]) == 0
    assert "4-bit checkpoint written to" in capsys.readouterr().out
    schemes = quantized_modules(json.loads((tmp_path / "q4h" / "config.json").read_text()), read_config(out))
    assert schemes["model.transformer.ff_out"] == QuantScheme(4, 128) == schemes["model.transformer.blocks.0.q_proj"]
    assert schemes["model.transformer.wte"] == EDGE_SCHEME
    assert main(["quantize", "--model", str(out), "--out", str(tmp_path / "q8b"), "--bits", "8"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llada: error: ") and "already quantized" in err and err.count("\n") == 1


def test_a_large_matrix_is_dequantized_in_row_blocks():
    """The float copy a float-activation matmul makes stays within FLOAT_COPY_BYTES (per-channel and
    group-wise): 4096 x 256 int8 would be 4 MiB of float32 at once, 16 blocks of 256 KiB are not."""
    import jax

    x = jax.ShapeDtypeStruct((1, 8, 256), jnp.float32)
    for groups, kind, nibbles in ((1, jnp.int8, False), (8, jnp.int4, False), (8, jnp.uint8, True)):
        scale = jax.ShapeDtypeStruct((4096, groups), jnp.float32)
        with mock.patch.object(qlinear, "FLOAT_COPY_BYTES", 256 << 10):
            block = row_block_for((4096, 256))
        values = jax.ShapeDtypeStruct((4096, 128 if nibbles else 256), kind)
        weight = QuantizedWeight(values, scale, "float", block, nibbles=nibbles)
        temp = jax.jit(quantized_linear).lower(x, weight).compile().memory_analysis().temp_size_in_bytes
        assert temp < 3 * (256 << 10), (groups, temp)


def test_group_dequantization_is_live_one_matrix_at_a_time():
    """XLA keeps one matrix's float copy live, not every layer's: neither its CPU scheduler (turned off by
    importing llada_jax) nor loop-invariant motion out of a while body (the barrier in quantized_linear)
    may start them all at once. 16 matrices of 256 x 256 float32 would be 4 MiB of temporaries."""
    import jax

    layers, width = 16, 256
    weights = [jax.ShapeDtypeStruct((width, width), jnp.int4)] * layers
    scales = [jax.ShapeDtypeStruct((width, width // 32), jnp.float32)] * layers
    x = jax.ShapeDtypeStruct((1, 8, width), jnp.float32)

    def stack(values, scale, h):
        for v, s in zip(values, scale):
            h = jnp.tanh(quantized_linear(h, QuantizedWeight(v, s)))
        return h

    def loop(values, scale, h):
        return jax.lax.fori_loop(0, 3, lambda _, carry: stack(values, scale, carry), h)

    one_matrix = width * width * 4
    for function in (stack, loop):
        temp = jax.jit(function).lower(weights, scales, x).compile().memory_analysis().temp_size_in_bytes
        assert temp < 3 * one_matrix, (function.__name__, temp)


def test_quant_agreement_reports_int8_close_to_float32(capsys):
    """eval.quant_agreement on the embedded model: int8's masked-position argmax agrees with float32's."""
    from eval.quant_agreement import main as agreement

    agreement(["--scheme", "int8", "--canvases", "2", "--length", "24"])
    row = json.loads(capsys.readouterr().out)
    assert row["scheme"] == "int8" and row["positions"] == 24
    assert row["argmax_agreement"] >= 0.9 and row["top5_agreement"] >= row["argmax_agreement"]
    assert 0 <= row["mean_kl"] < 0.05


def test_scale_checkpoint_rows_are_distinct():
    """eval.scale_checkpoint tiles one random pool: its size must be prime to every row width, or rows repeat
    (with 2**24, LLaDA-8B's LM head had 4096 distinct rows and every logit tied with 30 others)."""
    import math

    import ml_dtypes

    from eval import scale_checkpoint
    assert all(math.gcd(scale_checkpoint.POOL_SIZE, width) == 1 for width in (4096, 12288))
    pool = np.random.default_rng(0).standard_normal(97).astype(ml_dtypes.bfloat16)  # prime, as POOL_SIZE is to widths
    rows = scale_checkpoint.random_tensor((97, 8), pool, np.random.default_rng(1))
    assert len({row.tobytes() for row in rows}) == 97
    even = scale_checkpoint.random_tensor((96, 8), pool[:96], np.random.default_rng(1))
    assert len({row.tobytes() for row in even}) < 96


@settings(max_examples=50)
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(width=32, allow_nan=False)))
def test_rounded_bf16_is_the_bf16_conversion(x):
    """The short rounding the XLA dequantization uses gives XLA's own conversion for every non-NaN float."""
    got = np.asarray(qlinear.rounded_bf16(jnp.asarray(x)))
    assert np.array_equal(got.view(np.uint16), np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int4, jnp.uint8])
def test_small_integers_become_bf16_exactly(dtype):
    info = jnp.iinfo(dtype)
    values = jnp.arange(int(info.min), int(info.max) + 1).astype(dtype)
    got = np.asarray(qlinear.as_numbers(values, jnp.bfloat16)).astype(np.float32)
    assert np.array_equal(got, np.arange(int(info.min), int(info.max) + 1, dtype=np.float32))


def test_4_bits_where_no_group_size_divides_the_widths_is_refused_in_one_line(capsys, tmp_path):
    """A model 48 wide somewhere: no group of 32, 64 or 128 divides it, so 4 bits needs --bits 8 instead."""
    source = write_checkpoint(tmp_path / "src", dataclasses.replace(TINY, mlp_hidden_size=48))
    assert main(["quantize", "--model", str(source), "--out", str(tmp_path / "q4"), "--bits", "4"]) == 1
    assert capsys.readouterr().err == ("llada: error: no 4-bit group size (32, 64, 128) divides every input width of "
                                       "this model's matrices; quantize it with --bits 8 (and --head-bits 8)\n")
    assert main(["quantize", "--model", str(source), "--out", str(tmp_path / "q8"), "--bits", "8"]) == 0
    assert not (tmp_path / "q4").exists()
