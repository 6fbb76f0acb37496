"""Shared fixtures: tiny LLaDA checkpoints written in the real HF layout."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from safetensors import safe_open

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.params import init_params
from llada_jax.system.host_cpu import usable_threads
from llada_jax.weights.checkpoint import save_hf
from llada_jax.weights.memory_plan import available_memory

# Steps compile on first use, and session fixtures are deliberately shared across examples.
settings.register_profile("llada", deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
settings.load_profile("llada")

# The real LLaDA-8B-Instruct checkpoint's metadata files (config, shard index, tokenizer config), no weights.
LLADA_8B_DIR = Path(__file__).resolve().parent.parent / "eval" / "data" / "llada-8b-instruct"

# vocab 512 with mask id 500: nothing may assume the 8B's ids. Grouped K/V (4 heads, 2 kv-heads).
TINY = LLaDAConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=64, vocab_size=512,
                   embedding_size=512, max_sequence_length=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                   mask_token_id=500, eos_token_id=501, eot_token_id=502)


# A test worker's peak memory: JAX with its compiled steps, an IREE compile, a child `run.sh` or server.
WORKER_MEMORY = 4 << 30


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker a core, as many as the available memory holds; the
    variable PYTEST_XDIST_AUTO_NUM_WORKERS, as in pytest-xdist, sets the number instead."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores, memory = usable_threads(), available_memory()
    return max(1, min(cores, cores if memory is None else memory // WORKER_MEMORY))


@pytest.fixture(autouse=True, scope="module")
def release_compiled_steps():
    """Drop every compiled executable after each test file. Each one the process holds keeps its code
    mapped; the whole suite in one process reached Linux's limit of 65530 mappings and segfaulted inside
    XLA's executable loading."""
    yield
    jax.clear_caches()


def require(available: bool, what: str) -> None:
    """Skip a test whose system package is missing, with a one-line reason. Under CI (CI=true), whose
    `.ci/run` installs every system package, fail instead: CI never skips silently."""
    if available:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must provide {what}; .ci/run installs it with tests/system-packages.sh")
    pytest.skip(f"needs {what} (sudo bash tests/system-packages.sh installs it)")


def require_cpu_backend(what: str) -> None:
    """Skip a test of XLA's CPU path (our kernels, weights mapped in place) where JAX's default backend is an
    accelerator: a GPU user's test run. CI runs on CPUs."""
    if jax.default_backend() != "cpu":
        pytest.skip(f"{what} is XLA's CPU path; JAX's default backend here is {jax.default_backend()}")


def vulkan_available() -> bool:
    """IREE's Vulkan driver finds a device (Mesa's software llvmpipe will do)."""
    try:
        import iree.runtime as rt

        return bool(rt.get_driver("vulkan").query_available_devices())
    except Exception:  # no libvulkan or no ICD: IREE raises plain RuntimeErrors
        return False


def write_checkpoint(out_dir: Path, config: LLaDAConfig = TINY, seed: int = 0, std: float = 0.5,
                     stored_dtype: str = "float32", shard_bytes: int | None = None) -> Path:
    """Random weights (std large enough that predictions are not all ties) saved as an HF directory."""
    return save_hf(init_params(config, seed=seed, std=std), config, out_dir, stored_dtype=stored_dtype,
                   shard_bytes=shard_bytes)


def bundle_weight_bytes(model_dir: Path) -> int:
    """The bytes a bundle stores of `model_dir`'s weights: a device memory budget below them streams them."""
    from llada_jax.model.config import read_config
    from lowering.bundle_weights import weight_layout
    from lowering.stage_ring import byte_size

    return sum(map(byte_size, weight_layout(model_dir, read_config(model_dir)).parameters))


def cli_flags(options: dict) -> list[str]:
    """Command-line flags of keyword options: gen_length=16 -> --gen-length 16."""
    return [part for name, value in options.items() for part in (f"--{name.replace('_', '-')}", str(value))]


def in_mapped_file(array) -> bool:
    """Whether a device array's buffer lies in a memory-mapped .safetensors file of this process (Linux)."""
    address = array.unsafe_buffer_pointer()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(".safetensors"):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            if start <= address < end:
                return True
    return False


def read_all(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF directory as float64 numpy (for the reference oracle)."""
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name).astype(np.float64)
    return tensors


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def sharded_bf16_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "sharded", seed=1, stored_dtype="bfloat16",
                            shard_bytes=20_000)


BUNDLE_MAX_LEN = 32  # the shared host bundle's longest canvas


@pytest.fixture(scope="session")
def host_bundle(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model compiled for the host, steps for batches of 1 and 2 rows."""
    from lowering.bundle import compile_bundle

    return compile_bundle(tiny_dir, "host", tmp_path_factory.mktemp("bundles") / "host", max_len=BUNDLE_MAX_LEN,
                          window=BUNDLE_MAX_LEN, batch_sizes=(1, 2))


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    import llada_jax

    return llada_jax.load(tiny_dir)


def assert_close_to_scale(got: np.ndarray, want: np.ndarray, tol: float = 1e-5) -> None:
    """Float32 agreement: max |got - want| <= tol x the largest magnitude (logits here reach ~10)."""
    assert np.abs(got - want).max() <= tol * max(1.0, float(np.abs(want).max()))


def step_extras(config: LLaDAConfig = TINY, forbid=(), unconfident=()):
    """The runtime arguments every jitted step takes after its inputs: cfg scale and token biases."""
    import jax.numpy as jnp

    from llada_jax.model.readout import TokenBiases

    biases = TokenBiases.build(config.embedding_size, forbid, unconfident)
    return jnp.float32(0), jnp.asarray(biases.logit_bias), jnp.asarray(biases.confidence_bias)


def jax_backend(model, readout_spec=None):
    from llada_jax.backends.xla import JaxBackend
    from llada_jax.model.readout import ReadoutSpec, TokenBiases

    biases = TokenBiases.build(model.config.embedding_size)
    return JaxBackend(model.params, model.config, readout_spec or ReadoutSpec(), biases)
