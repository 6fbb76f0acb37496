"""The .safetensors reader and writer: files any reader accepts, tensors on 64-byte boundaries, and weights
that load in place (the device buffer is the file's own pages) where the file allows it."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import llada_jax
from llada_jax.cli import main
from llada_jax.model.params import params_to_hf
from llada_jax.system.errors import LladaError
from llada_jax.weights import safetensors_file
from llada_jax.weights.checkpoint import save_hf
from llada_jax.weights.safetensors_file import ALIGN, SafetensorsFile, write_safetensors
from tests.conftest import in_mapped_file, require_cpu_backend

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int32, np.int64, np.int8, np.uint8]


@st.composite
def tensor_sets(draw):
    count = draw(st.integers(1, 6))
    tensors = {}
    for number in range(count):
        shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        values = np.arange(int(np.prod(shape)), dtype=np.int64) * (number + 3) % 113
        tensors[f"t{number}.{draw(st.text('abcxyz', min_size=1, max_size=4))}"] = values.astype(dtype).reshape(shape)
    return tensors


@settings(max_examples=40, deadline=None)
@given(tensors=tensor_sets())
def test_written_files_read_back_exactly_by_any_reader_with_tensors_aligned(tmp_path_factory, tensors):
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    official = load_file(str(path))
    with SafetensorsFile(path) as ours:
        for name, value in tensors.items():
            for got in (official[name], ours.read(name), ours.mapped(name)):
                assert got.dtype == value.dtype and got.shape == value.shape
                assert got.tobytes() == value.tobytes(), name
            _, _, start, _ = ours.entries[name]
            if value.nbytes % ALIGN == 0:
                assert (ours.data_start + start) % ALIGN == 0, name


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets(), data=st.data())
def test_byte_ranges_that_overlap_leave_holes_or_miss_the_end_are_refused_as_hf_refuses_them(tmp_path_factory,
                                                                                            tensors, data):
    """One tensor's range moved (same length), or bytes added after the data: our reader accepts the file
    exactly when HF's does; two tensors sharing bytes would otherwise load as each other's weights."""
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    write_safetensors(path, tensors)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8: 8 + length]), raw[8 + length:]
    name = data.draw(st.sampled_from(sorted(header)))
    shift = data.draw(st.integers(-len(body), len(body)))
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [max(0, start + shift), max(0, start + shift) + end - start]
    body += b"\0" * data.draw(st.sampled_from([0, 0, 1, 64]))
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    try:
        load_file(str(path))
        hf_accepts = True
    except Exception:  # noqa: BLE001 - HF's reader raises its own error types
        hf_accepts = False
    try:
        SafetensorsFile(path).close()
        ours_accepts = True
    except LladaError as error:
        ours_accepts = False
        assert str(error).startswith(f"{path}: unreadable safetensors file (") and "\n" not in str(error)
    assert ours_accepts == hf_accepts, header


@settings(max_examples=20, deadline=None)
@given(tensors=tensor_sets(), piece=st.integers(1, 96), readers=st.integers(2, 5))
def test_a_tensor_read_in_pieces_at_once_is_the_tensor(tmp_path_factory, monkeypatch, tensors, piece, readers):
    """Large tensors are read in pieces by several threads: any piece size and count gives the same bytes, and
    a file cut short is a one-line error from whichever piece finds it."""
    monkeypatch.setattr(safetensors_file, "PIECE_BYTES", piece)
    monkeypatch.setattr(safetensors_file, "usable_threads", lambda: readers)
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    write_safetensors(path, tensors)
    with SafetensorsFile(path) as ours:
        for name, value in tensors.items():
            assert ours.read(name).tobytes() == value.tobytes(), name
    largest = max(tensors, key=lambda name: tensors[name].nbytes)
    if tensors[largest].nbytes > 1:
        with SafetensorsFile(path) as ours:
            _, _, _, end = ours.entries[largest]
            path.write_bytes(path.read_bytes()[: ours.data_start + end - 1])  # the header still says `end`
            with pytest.raises(LladaError, match="cannot be read \\(file truncated\\)"):
                ours.read(largest)


def write_misaligned(path: Path, value: np.ndarray) -> None:
    """A valid file whose one tensor starts 8 bytes past a 64-byte boundary (as many HF files do)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": list(value.shape), "data_offsets": [0, value.nbytes]}})
    header = header.encode() + b" " * (-(8 + len(header)) % ALIGN + 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + value.tobytes())


def test_mapped_is_a_read_only_view_where_aligned_and_a_copy_elsewhere(tmp_path):
    value = np.arange(64, dtype=np.float32).reshape(4, 16)
    write_safetensors(tmp_path / "aligned.safetensors", {"w": value})
    write_misaligned(tmp_path / "misaligned.safetensors", value)
    with SafetensorsFile(tmp_path / "aligned.safetensors") as aligned:
        view = aligned.mapped("w")
    with SafetensorsFile(tmp_path / "misaligned.safetensors") as misaligned:
        assert misaligned.data_start % ALIGN == 8
        copy = misaligned.mapped("w")
    assert not view.flags.writeable and not view.flags.owndata
    assert copy.flags.writeable and copy.ctypes.data % ALIGN == 0
    np.testing.assert_array_equal(view, value)  # the view outlives its file handle
    np.testing.assert_array_equal(copy, value)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's mappings from /proc")
def test_a_checkpoint_in_the_compute_dtype_loads_in_place_on_a_cpu_device(tmp_path, tiny_model):
    """Every matrix of a bf16 checkpoint loaded as bf16 is the file's pages (no copy); loaded as float32
    it is a converted copy with the same values."""
    require_cpu_backend("loading weights in place")
    saved = save_hf(tiny_model.params, tiny_model.config, tmp_path / "bf16", stored_dtype="bfloat16")
    copy = shutil.copytree(saved, tmp_path / "copy")
    converted = llada_jax.load(copy, dtype="float32")
    assert str(copy) not in Path("/proc/self/maps").read_text()  # what is converted is read, never mapped
    in_place = llada_jax.load(saved, dtype="bfloat16")
    mapped = params_to_hf(in_place.params, in_place.config)
    matrices = [(name, value) for name, value in mapped.items() if value.ndim == 2]
    assert matrices and all(in_mapped_file(value) for _, value in matrices)
    for name, value in params_to_hf(converted.params, converted.config).items():
        assert not in_mapped_file(value), name
        np.testing.assert_array_equal(np.asarray(value), np.asarray(mapped[name], np.float32))


def off_the_boundary(tiny_dir: Path, out: Path) -> Path:
    """`tiny_dir` as the official writer lays it out (header padded to 8 bytes only), here with every tensor
    off the 64-byte boundary."""
    stored = load_file(str(tiny_dir / "model.safetensors"))
    shutil.copytree(tiny_dir, out)
    for pad in range(ALIGN):
        save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt", "pad": "x" * pad})
        with SafetensorsFile(out / "model.safetensors") as handle:
            if handle.data_start % ALIGN:
                return out
    raise AssertionError("no padding put the tensors off the boundary")


def test_an_hf_file_off_the_boundary_loads_the_same_weights(tmp_path, tiny_dir):
    hf_dir = off_the_boundary(tiny_dir, tmp_path / "hf")
    model, stored = llada_jax.load(hf_dir), load_file(str(hf_dir / "model.safetensors"))
    for name, value in params_to_hf(model.params, model.config).items():
        assert np.asarray(value).tobytes() == stored[name].tobytes(), name


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's mappings from /proc")
def test_convert_relays_a_checkpoint_byte_for_byte_so_it_loads_in_place(tmp_path, tiny_dir, capsys):
    hf_dir = off_the_boundary(tiny_dir, tmp_path / "hf")
    (hf_dir / "notes.txt").write_text("the user's")
    assert main(["convert", "--model", str(hf_dir), "--out", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert "load in place" in capsys.readouterr().out and (out / "notes.txt").read_text() == "the user's"
    before, after = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys() and all(before[n].tobytes() == after[n].tobytes() for n in before)
    with SafetensorsFile(out / "model.safetensors") as handle:
        assert handle.metadata == {"format": "pt", "pad": handle.metadata["pad"]}
    model = llada_jax.load(out)
    matrices = [value for value in params_to_hf(model.params, model.config).values() if value.ndim == 2]
    assert jax.default_backend() != "cpu" or all(in_mapped_file(value) for value in matrices)  # a GPU copies
    ids, options = np.arange(3, 9), dict(gen_length=8, block_length=8, steps=8)
    assert (llada_jax.generate(model, ids, **options).output_ids.tolist()
            == llada_jax.generate(llada_jax.load(hf_dir), ids, **options).output_ids.tolist())
    assert main(["convert", "--model", str(hf_dir), "--out", str(hf_dir)]) == 1  # never over its input
    assert main(["convert", "--model", str(tmp_path / "out"), "--out", str(hf_dir)]) == 1  # nor over the user's
    assert capsys.readouterr().err.count("llada: error:") == 2 and (hf_dir / "notes.txt").is_file()
