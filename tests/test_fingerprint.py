"""A model's fingerprint (what an eval run's rows name it by): the same for a copy, another for other bytes."""

from __future__ import annotations

import shutil

from hypothesis import given
from hypothesis import strategies as st

from llada_jax.weights import fingerprint as fp
from tests.conftest import write_checkpoint


@given(size=st.integers(fp.WHOLE_FILE_BYTES + 1, 1 << 40))
def test_a_large_files_samples_lie_inside_it_from_its_first_to_its_last_bytes(size):
    offsets = fp.sample_offsets(size)
    assert offsets[0] == 0 and offsets[-1] + fp.SAMPLE_BYTES == size
    assert offsets == sorted(offsets) and len(offsets) == fp.SAMPLES


def test_a_copy_keeps_the_fingerprint_and_any_changed_byte_of_a_small_file_changes_it(tmp_path):
    model = write_checkpoint(tmp_path / "model")
    copy = shutil.copytree(model, tmp_path / "copy")
    assert fp.fingerprint(copy) == fp.fingerprint(model)
    weights = bytearray((copy / "model.safetensors").read_bytes())
    for position in (len(weights) // 2, len(weights) - 1):
        changed = weights.copy()
        changed[position] ^= 1
        (copy / "model.safetensors").write_bytes(changed)
        assert fp.fingerprint(copy) != fp.fingerprint(model)
    (copy / "model.safetensors").write_bytes(weights)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    assert fp.fingerprint(copy) != fp.fingerprint(model)
