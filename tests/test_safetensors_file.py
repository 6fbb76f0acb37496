"""The .safetensors reader and writer: files any reader accepts, tensors on 64-byte boundaries, and weights
that load in place (the device buffer is the file's own pages) where the file allows it."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import llada_jax
from llada_jax.checkpoint import save_hf
from llada_jax.params import params_to_hf
from llada_jax.safetensors_file import ALIGN, SafetensorsFile, write_safetensors
from tests.conftest import in_mapped_file

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
    saved = save_hf(tiny_model.params, tiny_model.config, tmp_path / "bf16", stored_dtype="bfloat16")
    copy = shutil.copytree(saved, tmp_path / "copy")
    converted = llada_jax.load(copy, dtype="float32")
    assert str(copy) not in Path("/proc/self/maps").read_text()  # what is converted is read, never mapped
    in_place = llada_jax.load(saved, dtype="bfloat16")
    matrices = [(name, value) for name, value in params_to_hf(in_place.params).items() if value.ndim == 2]
    assert matrices and all(in_mapped_file(value) for _, value in matrices)
    for name, value in params_to_hf(converted.params).items():
        assert not in_mapped_file(value), name
        np.testing.assert_array_equal(np.asarray(value), np.asarray(params_to_hf(in_place.params)[name], np.float32))


def test_an_hf_file_off_the_boundary_loads_the_same_weights(tmp_path, tiny_dir):
    """A file from the official writer (header padded to 8 bytes only), here one whose tensors all sit off
    the 64-byte boundary, loads by copy to the same values."""
    stored = load_file(str(tiny_dir / "model.safetensors"))
    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_dir, hf_dir)
    for pad in range(ALIGN):
        save_file(stored, str(hf_dir / "model.safetensors"), metadata={"format": "pt", "pad": "x" * pad})
        with SafetensorsFile(hf_dir / "model.safetensors") as handle:
            if handle.data_start % ALIGN:
                break
    model = llada_jax.load(hf_dir)
    for name, value in params_to_hf(model.params).items():
        assert np.asarray(value).tobytes() == stored[name].tobytes(), name
