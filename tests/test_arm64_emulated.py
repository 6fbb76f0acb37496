"""The arm64 artifacts run: the same steps compiled for aarch64 execute under qemu-aarch64 with IREE's
aarch64 runtime and give the host's outputs."""

from __future__ import annotations

import numpy as np
import pytest

from llada_jax.locations import user_cache_dir
from llada_jax.readout import ReadoutSpec, TokenBiases
from lowering.bundle import compile_bundle
from lowering.emulation import emulator_available, run_module, runtime_tools_dir
from lowering.runtime import IreeBackend, Session, load_bundle
from tests.conftest import TINY, require


@pytest.fixture(scope="module")
def tools():
    require(emulator_available(), "user-mode qemu with arm64 libraries (qemu-user-static libc6-arm64-cross "
                                  "libstdc++6-arm64-cross)")
    return runtime_tools_dir(user_cache_dir("tools"))


@pytest.mark.parametrize("target", ["linux-arm64", "android-arm64"])
def test_arm64_step_under_qemu_matches_host(tiny_dir, tmp_path, tools, target):
    arm = compile_bundle(tiny_dir, target, tmp_path / "arm", max_len=16, window=8)
    host = load_bundle(compile_bundle(tiny_dir, "host", tmp_path / "host", max_len=16, window=8))
    tokens = np.full((1, 16), TINY.mask_token_id, np.int32)
    tokens[0, :9] = np.arange(40, 49)
    valid = np.arange(16)[None] < 13
    zeros = np.zeros(TINY.embedding_size, np.float32)
    x0, logp, keys, _ = run_module(tools, arm / "steps.vmfb", "full_b1_s16",
                                   [tokens, valid.astype(np.int32), np.array(0, np.float32), zeros, zeros],
                                   [arm / "model.safetensors"], outputs=4)
    session = Session(host.path, host.manifest, "local-task")
    want = IreeBackend(host, session, ReadoutSpec(), TokenBiases.build(TINY.embedding_size)).full(tokens, valid)
    assert x0[:, :13].tolist() == want.readout.x0[:, :13].tolist()
    np.testing.assert_allclose(logp[:, :13], want.readout.logp[:, :13], atol=1e-4)
    np.testing.assert_allclose(keys[:, :, :13], session.read(want.keys)[:, :, :13], atol=1e-4)
