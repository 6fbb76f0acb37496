"""What config.json (and its quantization_config) implies each stored tensor is: a kind of dtype and a shape.
The loader checks each array it reads against it; `llada convert` checks the files' headers before it writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.params import hf_shapes
from llada_jax.quant.quantize import QuantScheme, packed_words
from llada_jax.system.errors import LladaError

# stored name -> (kind, shape): kind "float" (float32/16, bfloat16), "int32" (packed words) or "integer" (a
# module's stored shape, whose values the loader checks; shape None: any)
Layout = dict[str, tuple[str, tuple[int, ...] | None]]


def stored_layout(config: LLaDAConfig, quantized: dict[str, QuantScheme]) -> Layout:
    layout: Layout = {}
    for name, shape in hf_shapes(config).items():
        module = name[: -len(".weight")]
        if module not in quantized:
            layout[name] = ("float", shape)
            continue
        scheme, (rows, columns) = quantized[module], shape
        layout[f"{module}.weight_packed"] = ("int32", (rows, packed_words(columns, scheme.bits)))
        layout[f"{module}.weight_scale"] = ("float", (rows, scheme.groups(columns)))
        layout[f"{module}.weight_shape"] = ("integer", None)
    return layout


def check_stored(name: str, dtype, shape, expected: tuple[str, tuple[int, ...] | None], where: Path) -> None:
    """A one-line error unless a tensor of `dtype` and `shape` is what `expected` (a `stored_layout` entry) says."""
    kind, want = expected
    dtype = np.dtype(dtype)
    kinds = {"float": dtype.kind == "f" or dtype.name == "bfloat16", "int32": dtype == np.int32,
             "integer": dtype.kind in "iu"}
    if not kinds[kind] or (want is not None and tuple(shape) != tuple(want)):
        implied = kind if want is None else f"{kind} {list(want)}"
        raise LladaError(f"{where}: tensor {name} is {dtype} {list(shape)} but config.json implies {implied}")
