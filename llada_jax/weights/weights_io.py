"""Reading HF safetensors weights on the host (no JAX): which file holds which tensor, and every
tensor validated against the shape-only description as it is read. Faults are one-line LladaErrors.

A compressed-tensors checkpoint (see `quant_config`) stores each quantized module as packed integers
and scales; those are read back as one `HostQuantized` per module, under the module's `.weight` name.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from llada_jax.model.config import LLaDAConfig, read_hf_dict
from llada_jax.model.params import hf_shapes
from llada_jax.quant.quantize import HostQuantized, QuantScheme, packed_words
from llada_jax.system.errors import LladaError
from llada_jax.weights.quant_config import quantized_modules
from llada_jax.weights.safetensors_file import DTYPES, SafetensorsFile
from llada_jax.weights.stored_layout import check_stored, stored_layout

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16")


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
            if "/" in shard:  # the index names files beside it, never elsewhere
                raise LladaError(f"{index_path}: shard {shard} is not a file name in the model directory")
            if not (model_dir / shard).is_file():
                raise LladaError(f"{index_path}: shard {shard} is missing")
        return weight_map
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise LladaError(f"{model_dir}: no {SINGLE_FILE} and no {INDEX_FILE}")
    with SafetensorsFile(single) as handle:
        return {name: SINGLE_FILE for name in handle.entries}


def check_names(weight_map: dict[str, str], config: LLaDAConfig, where: Path,
                quantized: dict[str, QuantScheme] | None = None) -> None:
    expected = stored_layout(config, quantized or {})  # every tensor the checkpoint must hold
    missing = [name for name in expected if name not in weight_map]
    if missing:
        raise LladaError(f"{where}: missing tensor {missing[0]} ({len(missing)} missing in all)")
    unexpected = sorted(set(weight_map) - set(expected))
    if unexpected:
        raise LladaError(f"{where}: unexpected tensor {unexpected[0]} (config.json has n_layers={config.n_layers}"
                         f"{' and a quantization_config' if quantized else ', no quantization_config'})")


def checkpoint_quantization(model_dir: Path, config: LLaDAConfig) -> dict[str, QuantScheme]:
    """Module -> scheme for a compressed-tensors checkpoint; {} for a plain one, or for a directory with
    no config.json (a bundle's weights: the caller holds the config)."""
    if not (Path(model_dir) / "config.json").is_file():
        return {}
    return quantized_modules(read_hf_dict(model_dir), config)


def stored_scale_itemsize(model_dir: Path, quantized: dict[str, QuantScheme]) -> int:
    """Bytes per quantization scale as the checkpoint stores them (the widest, if its modules differ), from the
    shards' headers; 4 for a plain checkpoint or where they cannot be read (loading then names the fault)."""
    if not quantized:
        return 4
    try:
        weight_map = weight_files(model_dir)
        files = {weight_map[f"{module}.weight_scale"] for module in quantized if f"{module}.weight_scale" in weight_map}
        sizes = []
        for file in files:
            with SafetensorsFile(model_dir / file) as handle:
                sizes += [np.dtype(DTYPES[entry[0]]).itemsize for name, entry in handle.entries.items()
                          if name.endswith(".weight_scale")]
        return max(sizes, default=4)
    except LladaError:
        return 4


def iter_tensors(model_dir: Path, config: LLaDAConfig, weight_map: dict[str, str] | None = None,
                 quantized: dict[str, QuantScheme] | None = None, in_place=None, words_in_place=None,
                 copied=None):
    """(`.weight` name, host array or HostQuantized) for every tensor, in checkpoint order, validated,
    read one at a time. `weight_map` (tensor -> file, relative to model_dir or absolute) and
    `quantized` default to the directory's own. With `in_place` (a float dtype), what a caller uses as stored
    (float tensors stored in that dtype, quantization scales, and the packed words of the schemes for which
    `words_in_place(scheme)` holds) is a read-only view of the files' pages where aligned (see
    `SafetensorsFile.mapped`); everything else is read, so no page of a tensor the caller converts stays mapped.
    A quantized module for which `copied(module)` holds is read whole (a caller that stacks it into a new array)."""
    weight_map = weight_map or weight_files(model_dir)
    quantized = checkpoint_quantization(model_dir, config) if quantized is None else quantized
    check_names(weight_map, config, model_dir, quantized)
    shapes = hf_shapes(config)
    with contextlib.ExitStack() as files:
        handles: dict[str, SafetensorsFile] = {}

        def read(name: str, mapped: bool = False, dtype=None) -> np.ndarray:
            file = weight_map[name]
            if file not in handles:
                handles[file] = files.enter_context(SafetensorsFile(model_dir / file))
            if name not in handles[file].entries:
                raise LladaError(f"{model_dir / file}: tensor {name} is listed in the index but not in this shard")
            return handles[file].mapped(name, dtype) if mapped else handles[file].read(name)

        for name, shape in shapes.items():
            module = name[: -len(".weight")]
            if module in quantized:
                scheme = quantized[module]
                mapping = in_place is not None and not (copied is not None and copied(module))
                words = mapping and words_in_place is not None and words_in_place(scheme)
                yield name, _read_quantized(read, module, shape, scheme, model_dir, mapping, words)
            else:
                yield name, _check_float(read(name, in_place is not None, in_place), name, shape, model_dir)


def _check_float(array: np.ndarray, name: str, shape: tuple[int, ...], where: Path) -> np.ndarray:
    check_stored(name, array.dtype, array.shape, ("float", shape), where)
    return array


def _read_quantized(read, module: str, shape: tuple[int, ...], scheme: QuantScheme, where: Path,
                    scales_in_place: bool = False, words_in_place: bool = False) -> HostQuantized:
    """The module's parts, its scales and packed words mapped where asked and aligned."""
    rows, columns = shape
    words = packed_words(columns, scheme.bits)
    packed = read(f"{module}.weight_packed", words_in_place, np.int32)
    scale, stored_shape = read(f"{module}.weight_scale", scales_in_place), read(f"{module}.weight_shape")
    if stored_shape.reshape(-1).tolist() != [rows, columns]:
        raise LladaError(f"{where}: {module}.weight_shape is {stored_shape.tolist()} but config.json implies "
                         f"{[rows, columns]}")
    check_stored(f"{module}.weight_packed", packed.dtype, packed.shape, ("int32", (rows, words)), where)
    check_stored(f"{module}.weight_scale", scale.dtype, scale.shape, ("float", (rows, scheme.groups(columns))), where)
    return HostQuantized(packed, scale, scheme, columns)


def check_finite_weights(model_dir: Path, config: LLaDAConfig, rows: int = 4096) -> None:
    """Scan every tensor (every quantization scale) for NaN/Inf, `rows` rows at a time (no full float
    copy of a large tensor); the first non-finite value is a one-line error naming the tensor and index."""
    for name, array in iter_tensors(model_dir, config):
        if isinstance(array, HostQuantized):
            name, array = name.replace(".weight", ".weight_scale"), array.scale
        flat = array.reshape(array.shape[0], -1) if array.ndim else array.reshape(1, 1)
        for start in range(0, flat.shape[0], rows):
            bad = np.flatnonzero(~np.isfinite(flat[start: start + rows]))
            if bad.size:
                first = start * flat.shape[1] + bad[0]
                index = [int(i) for i in np.unravel_index(first, array.shape)]
                raise LladaError(f"{model_dir}: tensor {name} holds a non-finite value "
                                 f"({array.reshape(-1)[first]}) at index {index}")
