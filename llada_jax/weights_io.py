"""Reading HF safetensors weights on the host (no JAX): which file holds which tensor, and every
tensor validated against the shape-only description as it is read. Faults are one-line LladaErrors."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can return it)
import numpy as np
from safetensors import SafetensorError, safe_open

from llada_jax.config import LLaDAConfig
from llada_jax.errors import LladaError
from llada_jax.params import hf_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
STORED_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}


def weight_files(model_dir: Path) -> dict[str, str]:
    """Tensor name -> file name, from the index if sharded, else from the single file's header."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise LladaError(f"{index_path}: not a valid safetensors index (needs a 'weight_map' object)") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise LladaError(f"{index_path}: 'weight_map' must map tensor names to file names")
        for shard in sorted(set(weight_map.values())):
            if "/" in shard or not (model_dir / shard).is_file():
                raise LladaError(f"{index_path}: shard {shard} is missing")
        return weight_map
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise LladaError(f"{model_dir}: no {SINGLE_FILE} and no {INDEX_FILE}")
    with _open(single) as handle:
        return {name: SINGLE_FILE for name in handle.keys()}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="np")
    except (SafetensorError, OSError) as err:
        raise LladaError(f"{path}: unreadable safetensors file ({str(err).splitlines()[0]})") from None


def check_names(weight_map: dict[str, str], config: LLaDAConfig, where: Path) -> None:
    expected = hf_shapes(config)
    missing = [name for name in expected if name not in weight_map]
    if missing:
        raise LladaError(f"{where}: missing tensor {missing[0]} ({len(missing)} missing in all)")
    unexpected = sorted(set(weight_map) - set(expected))
    if unexpected:
        raise LladaError(f"{where}: unexpected tensor {unexpected[0]} (config.json has n_layers={config.n_layers})")


def iter_tensors(model_dir: Path, config: LLaDAConfig, weight_map: dict[str, str] | None = None):
    """(name, host array) for every tensor, validated, one at a time from the memory-mapped files.
    `weight_map` (tensor -> file, relative to model_dir or absolute) defaults to the directory's own."""
    weight_map = weight_map or weight_files(model_dir)
    check_names(weight_map, config, model_dir)
    expected = hf_shapes(config)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        path = model_dir / file
        with _open(path) as handle:
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise LladaError(f"{path}: tensor {name} is listed in the index but not in this shard")
                yield name, _read_one(handle, name, expected[name], path)


def check_finite_weights(model_dir: Path, config: LLaDAConfig, rows: int = 4096) -> None:
    """Scan every tensor for NaN/Inf, `rows` rows at a time (no full float copy of a large tensor);
    the first non-finite value is a one-line error naming the tensor and its index."""
    for name, array in iter_tensors(model_dir, config):
        flat = array.reshape(array.shape[0], -1) if array.ndim else array.reshape(1, 1)
        for start in range(0, flat.shape[0], rows):
            bad = np.flatnonzero(~np.isfinite(flat[start: start + rows]))
            if bad.size:
                first = start * flat.shape[1] + bad[0]
                index = [int(i) for i in np.unravel_index(first, array.shape)]
                raise LladaError(f"{model_dir}: tensor {name} holds a non-finite value "
                                 f"({array.reshape(-1)[first]}) at index {index}")


def _read_one(handle, name: str, shape: tuple[int, ...], path: Path) -> np.ndarray:
    view = handle.get_slice(name)
    stored_dtype, stored_shape = view.get_dtype(), tuple(view.get_shape())
    if stored_dtype not in STORED_DTYPES:
        raise LladaError(f"{path}: tensor {name} has unsupported dtype {stored_dtype}")
    if stored_shape != shape:
        raise LladaError(f"{path}: tensor {name} has shape {list(stored_shape)} but config.json implies {list(shape)}")
    try:
        array = handle.get_tensor(name)
    except (SafetensorError, OSError) as err:
        raise LladaError(f"{path}: tensor {name} cannot be read ({err})") from None
    return array
