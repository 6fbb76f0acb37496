"""Our activation preparation (`llada_jax/kernels/c/activations.c`) built for every ISA path this host can run and
for arm64 (under qemu), bit for bit the numpy statement's, from either layout (`tests/kernel_statement.py`)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llada_jax.kernels.build import find_toolchain, shared_library
from tests import kernel_statement as statement
from tests.conftest import require
from tests.test_kernels import ARM64_BUILDS, arm64_runner, draw_problem, isa_builds


@pytest.fixture(scope="module", params=[("host", build) for build in isa_builds()] +
                [("arm64", build) for build in ARM64_BUILDS], ids=lambda param: f"{param[0]} {' '.join(param[1])}")
def preparation(request, tmp_path_factory):
    """`preparation(x, feature_major, nibbles, int8)` of one build: this host's through ctypes, arm64's under qemu."""
    cpu, build = request.param
    if cpu == "arm64":
        return functools.partial(statement.prepare_with_program, arm64_runner(build, tmp_path_factory.mktemp("arm")))
    toolchain = find_toolchain()
    require(toolchain is not None, "a C compiler (gcc or clang, with c++)")
    assert toolchain is not None
    return functools.partial(statement.prepare_with_library, shared_library(toolchain, build))


@settings(max_examples=12, deadline=None)
@given(data=st.data(), feature_major=st.booleans(), nibbles=st.booleans())
def test_each_build_prepares_activations_as_stated(preparation, data, feature_major, nibbles):
    x, _, _ = draw_problem(data, 4)
    for got, want in zip(preparation(x, feature_major, nibbles, True), statement.quantize_activations(x, nibbles)):
        np.testing.assert_array_equal(got, want.swapaxes(0, 1))  # block-major, as the kernels read
    ordered = preparation(x, feature_major, True, False)[0]
    np.testing.assert_array_equal(ordered, statement.block_order(x, True).swapaxes(0, 1))
