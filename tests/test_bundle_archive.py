"""A CPU bundle's parameter archive (`lowering.bundle_weights.write_archive`) holds each stored tensor as the step
reads it: float bytes as they are, the packed integers of XLA's-code modules signed, and each stack of expert
tensors one entry of their bytes back to back, in order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from llada_jax.quant.quantize import QuantScheme
from lowering.bundle_weights import SIGN_BITS, write_archive

TENSOR = st.tuples(st.sampled_from(["float", "int4", "int8"]), st.integers(1, 5), st.integers(1, 40))


@settings(max_examples=25, deadline=None)
@given(tensors=st.lists(TENSOR, min_size=1, max_size=8), stacked=st.data(), seed=st.integers(0, 2**16))
def test_the_archive_holds_each_tensor_and_each_stack_as_the_step_reads_it(tmp_path_factory, tensors, stacked, seed):
    rng = np.random.default_rng(seed)
    stored, quantized = {}, {}
    for i, (kind, rows, words) in enumerate(tensors):
        if kind == "float":
            stored[f"t{i}.weight"] = rng.normal(size=(rows, words)).astype(np.float32)
        else:
            stored[f"t{i}.weight_packed"] = rng.integers(0, 2**32, (rows, words), dtype=np.uint32)
            quantized[f"t{i}"] = QuantScheme(int(kind[3:]), None)
    names = list(stored)
    members = stacked.draw(st.lists(st.sampled_from(names), unique=True))
    cut = stacked.draw(st.integers(0, len(members)))
    stacks = {f"stack{j}": tuple(group) for j, group in enumerate((members[:cut], members[cut:])) if group}
    root = tmp_path_factory.mktemp("archive")
    half = len(names) // 2  # two files, as a sharded checkpoint
    files = [root / "a.safetensors", root / "b.safetensors"]
    save_file({name: stored[name] for name in names[:half]}, str(files[0]))
    save_file({name: stored[name] for name in names[half:]}, str(files[1]))
    write_archive(files, root / "weights.irpa", quantized, stacks)

    import iree.runtime as rt

    archive = rt.ParameterIndex()
    archive.load(str(root / "weights.irpa"))
    entries = {name: bytes(entry.file_view) for name, entry in archive.items()}

    def held(name: str) -> bytes:
        module = name.removesuffix(".weight_packed")
        return (stored[name] ^ SIGN_BITS[quantized[module].bits]).tobytes() if module in quantized else \
            stored[name].tobytes()

    assert entries.keys() == (set(names) - set(members)) | set(stacks)
    for name in set(names) - set(members):
        assert entries[name] == held(name)
    for stack, keys in stacks.items():
        assert entries[stack] == b"".join(map(held, keys))
