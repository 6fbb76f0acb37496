"""The memory plan is honest (it counts exactly the weight bytes a loaded model holds) and a model that
cannot fit is refused in one line, before any weight is read."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

import llada_jax
from llada_jax.kernels import xla as own_kernels
from llada_jax.quant.qlinear import QuantizedWeight, nbytes
from llada_jax.quant.quantize import QuantScheme
from llada_jax.system.errors import LladaError
from llada_jax.system.host_memory import release_freed_memory
from llada_jax.weights import loading
from llada_jax.weights.memory_plan import ENV_OVERRIDE, weight_bytes
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
from tests.conftest import TINY, require, require_cpu_backend


def held_bytes(params: dict) -> int:
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight))
    return sum(nbytes(leaf) for leaf in leaves)


@pytest.fixture(scope="module")
def quantized_dirs(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized")
    return {bits: quantize_checkpoint(tiny_dir, out / f"q{bits}", QuantScheme(bits, None if bits == 8 else 16))
            for bits in (8, 4)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_counts_the_float_weights_held(tiny_dir, dtype):
    model = llada_jax.load(tiny_dir, dtype=dtype)
    assert model.weight_bytes == held_bytes(model.params)
    assert model.weight_bytes == weight_bytes(TINY, 4 if dtype == "float32" else 2, {})


@pytest.mark.parametrize("bits", [8, 4])
def test_plan_counts_the_quantized_weights_held(quantized_dirs, bits):
    model = llada_jax.load(quantized_dirs[bits])
    assert model.quantized and model.weight_bytes == held_bytes(model.params)


def test_a_model_that_cannot_fit_is_refused_naming_what_fits(tiny_dir, monkeypatch):
    require_cpu_backend("checking the host's memory")
    need = llada_jax.load(tiny_dir).weight_bytes
    monkeypatch.setenv(ENV_OVERRIDE, str(need // 2))
    with pytest.raises(LladaError) as refused:
        llada_jax.load(tiny_dir)
    message = str(refused.value)
    assert "needs" in message and "available" in message and "\n" not in message
    monkeypatch.setenv(ENV_OVERRIDE, str(need * 100))
    assert llada_jax.load(tiny_dir).params is not None


def test_quantized_checkpoints_stage_their_integers(quantized_dirs):
    model = llada_jax.load(quantized_dirs[8], device_memory_budget=1000)
    assert model.params is None and model.staged.quantization[0]


@pytest.mark.parametrize("value", ["1000", "lots"])
def test_cli_refusal_is_one_line(tiny_dir, value):
    require_cpu_backend("checking the host's memory")
    proc = subprocess.run([sys.executable, "-m", "llada_jax.cli", "generate", "--model", str(tiny_dir),
                           "--prompt-ids", "1,2,3", "--json"], capture_output=True, text=True,
                          env={**os.environ, ENV_OVERRIDE: value})
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llada: error:"), proc.stderr


def test_int8_activations_need_layers_a_kernel_takes(tiny_dir, quantized_dirs):
    with pytest.raises(LladaError, match="--activations int8 needs a quantized checkpoint"):
        llada_jax.load(tiny_dir, activations="int8")
    with pytest.raises(LladaError, match="activations must be one of float, int8"):
        llada_jax.load(tiny_dir, activations="fp4")
    with pytest.raises(LladaError, match="on 4-bit or group-wise layers needs our kernels"):
        llada_jax.load(quantized_dirs[4], activations="int8", kernels="compiler")
    with pytest.raises(LladaError, match="kernels must be one of own, compiler"):
        llada_jax.load(quantized_dirs[4], kernels="fast")
    int8 = llada_jax.load(quantized_dirs[8], activations="int8", kernels="compiler").params["blocks"][0]["q_proj"]
    assert int8.activations == "int8" and int8.kernel == ""


def test_int8_activations_with_our_kernels_need_groups_of_whole_blocks(quantized_dirs):
    require_cpu_backend("running our kernels")
    require(own_kernels.available() is not None, "a C compiler (gcc or clang, with c++)")
    with pytest.raises(LladaError, match="groups of 16 .*--group-size 32"):
        llada_jax.load(quantized_dirs[4], activations="int8")  # group 16: no kernel takes it
    assert llada_jax.load(quantized_dirs[8], activations="int8").params["blocks"][0]["q_proj"].kernel == "w8a8"


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim")
def test_loading_releases_freed_memory_on_linux(tiny_dir, monkeypatch):
    """Loading ends with glibc's malloc_trim (see llada_jax.system.host_memory), found on Linux."""
    assert release_freed_memory()
    calls = []
    monkeypatch.setattr(loading, "release_freed_memory", lambda: calls.append("trim"))
    llada_jax.load(tiny_dir)
    assert calls == ["trim"]
