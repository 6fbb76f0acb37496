"""HF LLaDA checkpoints (safetensors, single file or sharded) in and out, plus orbax save/restore.

Every tensor is checked against the shape-only description before use; any fault is a one-line
`LladaError` naming the tensor, file or field. Tensors are read one at a time from memory-mapped
files, so at most one full copy of the weights (the device one) is ever held.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can return it)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from llada_jax.config import LLaDAConfig
from llada_jax.errors import LladaError
from llada_jax.params import hf_shapes, hf_to_params, params_to_hf

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
STORED_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(name: str):
    if name not in COMPUTE_DTYPES:
        raise LladaError(f"unknown dtype {name!r}; choose one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name]


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


def read_tensors(model_dir: Path, config: LLaDAConfig, dtype) -> dict[str, jax.Array]:
    """Load and validate every tensor, converting each to the compute dtype on the device."""
    return {name: jnp.asarray(array, dtype=dtype) for name, array in iter_tensors(model_dir, config)}


def iter_tensors(model_dir: Path, config: LLaDAConfig):
    """(name, host array) for every tensor, validated, one at a time from the memory-mapped files."""
    weight_map = weight_files(model_dir)
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


def load_params(model_dir: Path, config: LLaDAConfig, dtype="float32") -> dict:
    return hf_to_params(read_tensors(Path(model_dir), config, compute_dtype(dtype)), config)


def save_hf(params: dict, config: LLaDAConfig, out_dir: Path, *, stored_dtype: str = "float32",
            shard_bytes: int | None = None, extra_files: dict[str, Path] | None = None) -> Path:
    """Write an HF LLaDA directory atomically (temp dir + rename): config.json, weights (one file, or
    shards + index when `shard_bytes` is set), and any `extra_files` (name -> source path)."""
    out_dir = Path(out_dir)
    if stored_dtype not in ("float32", "bfloat16"):
        raise LladaError(f"cannot store weights as {stored_dtype!r}; use float32 or bfloat16")
    np_dtype = np.float32 if stored_dtype == "float32" else ml_dtypes.bfloat16
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        hf_config = dict(config.to_hf_dict(), torch_dtype=stored_dtype)
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        tensors = {name: np.asarray(value).astype(np_dtype) for name, value in params_to_hf(params).items()}
        _write_weights(tensors, staging, shard_bytes)
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, staging / name)
        _publish_permissions(staging)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _write_weights(tensors: dict[str, np.ndarray], out_dir: Path, shard_bytes: int | None) -> None:
    metadata = {"format": "pt"}
    if shard_bytes is None:
        save_file(tensors, str(out_dir / SINGLE_FILE), metadata=metadata)
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
        save_file(shard, str(out_dir / file), metadata=metadata)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _publish_permissions(directory: Path) -> None:
    """mkdtemp makes a private directory; a model directory is readable like any other."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Move `staging` to `out_dir`; an existing `out_dir` is swapped out only once the new one is complete."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(staging, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out_dir)


def save_orbax(params: dict, path: Path) -> None:
    """Save params with orbax (path must not exist yet; orbax writes atomically)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(Path(path).absolute(), params)


def restore_orbax(path: Path, abstract: dict) -> dict:
    """Restore params saved by `save_orbax`, shaped and typed like `abstract`."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not path.exists():
        raise LladaError(f"{path}: no orbax checkpoint there")
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, abstract)
