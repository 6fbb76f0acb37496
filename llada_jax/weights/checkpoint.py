"""HF LLaDA checkpoints (safetensors, single file or sharded) in and out.

Every tensor is checked against the shape-only description before use; any fault is a one-line
`LladaError` naming the tensor, file or field. Tensors are read one at a time (`weights_io`), so at
most one full copy of the weights (the device one) is ever held.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can return it)
import numpy as np

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.mesh import place_weight
from llada_jax.model.moe import stacked
from llada_jax.model.params import hf_to_params, params_to_hf, tensor_places, tensor_role
from llada_jax.quant.choice import Kernels
from llada_jax.quant.qlinear import to_device, uses_stored_words
from llada_jax.quant.quantize import Activations, HostQuantized
from llada_jax.system.atomic import atomic_dir
from llada_jax.system.errors import LladaError
from llada_jax.system.host_memory import aligned_empty
from llada_jax.weights.safetensors_file import write_safetensors
from llada_jax.weights.weights_io import INDEX_FILE, SINGLE_FILE, iter_tensors

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(name: str):
    if name not in COMPUTE_DTYPES:
        raise LladaError(f"unknown dtype {name!r}; choose one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name]


def read_tensors(model_dir: Path, config: LLaDAConfig, dtype, activations: Activations = "float", mesh=None,
                 quantized: dict | None = None, wrap=iter, kernels: Kernels = "compiler", stacks: dict | None = None
                 ) -> dict:
    """Load and validate every tensor, converting each to the compute dtype on the device, or with a
    `jax.sharding.Mesh`, straight into its shards there (quantized matrices stay integers, see `qlinear`).
    `quantized` (module -> scheme) defaults to what the directory's config.json says; `wrap` wraps the
    stream of (name, tensor) pairs (a progress bar). With `stacks` (a dict to fill), each MoE matrix kind's
    experts are read by copy and stacked into `stacks[(layer, key)]` once the layer's last one is read
    (`llada_jax.model.moe.stacked`), not returned: no page of theirs stays mapped, one kind's copies at a time."""
    tensors = {}
    # Only one CPU device uses host buffers in place; elsewhere a mapped view would only add to RSS.
    in_place = np.dtype(dtype) if mesh is None and jax.default_backend() == "cpu" else None
    places = tensor_places(config)
    experts = {name.removesuffix(".weight") for name, place in places.items() if len(place) == 4}
    pending: dict[tuple, list] = {}

    def words(scheme) -> bool:  # our kernels read every matrix's bytes as stored
        return kernels == "own" or uses_stored_words(scheme, activations)

    tensors_read = iter_tensors(model_dir, config, quantized=quantized, in_place=in_place, words_in_place=words,
                                copied=experts.__contains__ if stacks is not None else None)
    for name, array in wrap(tensors_read):
        put = jax.device_put if mesh is None else functools.partial(place_weight, name=tensor_role(name, config),
                                                                    mesh=mesh)
        tensor = (to_device(array, activations, put, kernels) if isinstance(array, HostQuantized)
                  else put(in_dtype(array, dtype)))
        if stacks is None or len(places[name]) != 4:
            tensors[name] = tensor
            continue
        kind = pending.setdefault(places[name][1:3], [])
        kind.append(tensor)
        if len(kind) == config.n_experts:
            stacks[places[name][1:3]] = stacked(pending.pop(places[name][1:3]))
    return tensors


def in_dtype(array: np.ndarray, dtype) -> np.ndarray:
    """`array` itself when it already has `dtype` (a CPU device then uses an aligned one in place), else an
    aligned converted copy."""
    if array.dtype == dtype:
        return array
    out = aligned_empty(array.shape, dtype)
    np.copyto(out, array, casting="unsafe")
    return out


def load_params(model_dir: Path, config: LLaDAConfig, dtype="float32", activations: Activations = "float",
                mesh=None, quantized: dict | None = None, wrap=iter, kernels: Kernels = "compiler",
                stack_experts: bool = False) -> dict:
    """The params pytree; with `stack_experts` (our kernels take every expert matrix,
    `llada_jax.model.moe.kernels_take_experts`), each MoE matrix kind's experts one stack `[E, ...]`."""
    stacks: dict | None = {} if stack_experts else None
    tensors = read_tensors(Path(model_dir), config, compute_dtype(dtype), activations, mesh, quantized, wrap,
                           kernels, stacks)
    return hf_to_params(tensors, config, stacks)


def save_hf(params: dict, config: LLaDAConfig, out_dir: Path, *, stored_dtype: str = "float32",
            shard_bytes: int | None = None, extra_files: dict[str, Path] | None = None, command: str = "save_hf",
            inputs=(), force: bool = False) -> Path:
    """Write an HF LLaDA directory atomically (temp dir + rename): config.json, weights (one file, or
    shards + index when `shard_bytes` is set), and any `extra_files` (name -> source path). It replaces only
    an earlier output of `command`, with `force`, and never contains `inputs` (`llada_jax.system.atomic`)."""
    out_dir = Path(out_dir)
    if stored_dtype not in ("float32", "bfloat16"):
        raise LladaError(f"cannot store weights as {stored_dtype!r}; use float32 or bfloat16")
    np_dtype = np.float32 if stored_dtype == "float32" else ml_dtypes.bfloat16
    sources = (*inputs, *(extra_files or {}).values())
    with atomic_dir(out_dir, command, inputs=sources, force=force) as staging:
        hf_config = dict(config.to_hf_dict(), torch_dtype=stored_dtype)
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        tensors = {name: np.asarray(value).astype(np_dtype) for name, value in params_to_hf(params, config).items()}
        _write_weights(tensors, staging, shard_bytes)
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, staging / name)
    return out_dir


def _write_weights(tensors: dict[str, np.ndarray], out_dir: Path, shard_bytes: int | None) -> None:
    metadata = {"format": "pt"}
    if shard_bytes is None:
        write_safetensors(out_dir / SINGLE_FILE, tensors, metadata)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out_dir / file, shard, metadata)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
