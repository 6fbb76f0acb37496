"""The weights a bundle reads as IREE named parameters, with the checkpoint's names and shapes (no JAX).

IREE binds each parameter to a byte range of a weights file: the checkpoint's own safetensors files, or a
CPU bundle's parameter archive (`write_archive`), the same tensors with the quantized integers signed.
A float tensor is one parameter of its stored dtype. A quantized module (compressed-tensors
"pack-quantized", see `llada_jax.weights.quant_config`) is two:
- `<module>.weight_packed`, declared as an `[O, I]` i4 or i8 tensor. Its int32 words hold 32 / bits
  values, the first in the lowest bits, so on a little-endian device their bytes are an `[O, I]`
  array of 4-bit values (two per byte, low nibble first) or bytes. In the checkpoint each is offset by
  2**(bits-1), which the step undoes (`llada_jax.quant.qlinear.offset_values`); in an archive they are signed.
- `<module>.weight_scale` `[O, G]`, in its stored float dtype.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from llada_jax.kernels.schemes import scheme_for
from llada_jax.model.config import LLaDAConfig
from llada_jax.model.params import hf_shapes, tensor_places, tensor_role
from llada_jax.quant.quantize import QuantScheme
from llada_jax.system.errors import LladaError
from llada_jax.weights.safetensors_file import SafetensorsFile
from llada_jax.weights.weights_io import check_names, checkpoint_quantization, weight_files

FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclasses.dataclass(frozen=True)
class Parameter:
    name: str                # the tensor's name in the checkpoint
    shape: tuple[int, ...]   # as the step declares it
    dtype: str               # float32, bfloat16, float16, int4 or int8


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    parameters: tuple[Parameter, ...]
    quantized: dict[str, QuantScheme]  # module -> scheme ({} for a float checkpoint)
    # Quantized integers as the bundle holds them: False, offset as the checkpoint stores them; True, signed
    # (a bundle's own archive, `write_archive`), so that the step reads them with a bare sign-extend.
    signed: bool = False
    # Modules our kernels multiply (module -> "w4a8" | "w4a16" | "w8a8"): their `weight_packed` is declared as the
    # bytes it is stored as, `[O, I * bits / 8]` int8, offset as stored (the kernels read it so), in any file.
    kernels: dict[str, str] = dataclasses.field(default_factory=dict)
    # The layers' and the LM head's tensors are read by the program stage by stage under a device memory budget
    # (`lowering.stage_ring`), not held resident.
    streamed: bool = False
    # Under a budget too small for the embedding beside the ring, it streams too, in chunks of rows.
    streams_embedding: bool = False
    # A stack's name (`expert_stack`) -> its experts' tensors in the checkpoint, in expert order: an MoE matrix
    # kind's experts held as one parameter `[E, ...]` (`with_stacked_experts`).
    stacks: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def manifest(self) -> list[dict]:
        return [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype} for p in self.parameters]


def weight_layout(model_dir: Path, config: LLaDAConfig) -> WeightLayout:
    """Every parameter of `model_dir`'s checkpoint, checked against config.json, in `hf_shapes` order."""
    quantized = checkpoint_quantization(model_dir, config)
    weight_map = weight_files(model_dir)
    check_names(weight_map, config, model_dir, quantized)
    stored = {}
    for file in sorted(set(weight_map.values())):
        with SafetensorsFile(model_dir / file) as handle:
            stored.update({name: (dtype, tuple(shape)) for name, (dtype, shape, _, _) in handle.entries.items()})
    parameters = []
    for name, shape in hf_shapes(config).items():
        module = name[: -len(".weight")]
        if module in quantized:
            parameters += _quantized_parameters(module, shape, quantized[module], stored, model_dir)
        else:
            parameters.append(Parameter(name, shape, _float_dtype(name, stored[name][0], model_dir)))
    return WeightLayout(tuple(parameters), quantized)


def _float_dtype(name: str, dtype: str, where: Path) -> str:
    if dtype not in FLOAT_DTYPES:
        raise LladaError(f"{where}: tensor {name} is {dtype}; a bundle needs one of {', '.join(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[dtype]


def _quantized_parameters(module: str, shape: tuple[int, ...], scheme: QuantScheme, stored: dict,
                          where: Path) -> list[Parameter]:
    rows, columns = shape
    if columns * scheme.bits % 32:
        raise LladaError(f"{where}: {module} has {columns} input columns; a bundle reads packed {scheme.bits}-bit "
                         f"rows in place only when they fill whole int32 words (a multiple of {32 // scheme.bits})")
    packed, scale = stored[f"{module}.weight_packed"], stored[f"{module}.weight_scale"]
    if packed != ("I32", (rows, columns * scheme.bits // 32)):
        raise LladaError(f"{where}: {module}.weight_packed must be I32 {[rows, columns * scheme.bits // 32]}, "
                         f"got {packed[0]} {list(packed[1])}")
    if scale[1] != (rows, scheme.groups(columns)):
        raise LladaError(f"{where}: {module}.weight_scale must be {[rows, scheme.groups(columns)]}, "
                         f"got {list(scale[1])}")
    return [Parameter(f"{module}.weight_packed", shape, f"int{scheme.bits}"),
            Parameter(f"{module}.weight_scale", scale[1], _float_dtype(f"{module}.weight_scale", scale[0], where))]


def with_kernels(layout: WeightLayout, activations: str, config: LLaDAConfig) -> WeightLayout:
    """`layout` with every quantized matrix one of our kernels takes declared for it (`WeightLayout.kernels`);
    the embedding, a table the step reads rows of, keeps its declaration."""
    kernels, parameters = {}, []
    for parameter in layout.parameters:
        module = parameter.name.removesuffix(".weight_packed")
        scheme = layout.quantized.get(module) if module != parameter.name else None
        if scheme is not None and tensor_role(module + ".weight", config) != "wte":
            rows, columns = parameter.shape
            kernel = scheme_for(scheme.bits, activations, columns, scheme.group_size or columns)
            if kernel:
                kernels[module] = kernel
                parameter = Parameter(parameter.name, (rows, columns * scheme.bits // 8), "int8")
        parameters.append(parameter)
    return dataclasses.replace(layout, parameters=tuple(parameters), kernels=kernels)


def expert_stack(name: str, config: LLaDAConfig) -> str | None:
    """The stack a tensor belongs to, `blocks.<layer>.<key>.<part>`, if it is an MoE expert matrix's (its weight,
    packed values or scales): the same tensor of the layer's other experts; else None."""
    places = tensor_places(config)
    module, _, part = name.rpartition(".")
    place = places.get(module + ".weight") if part != "weight" else places.get(name)
    return f"blocks.{place[1]}.{place[2]}.{part}" if place is not None and len(place) == 4 else None


def with_stacked_experts(layout: WeightLayout, config: LLaDAConfig) -> WeightLayout:
    """`layout` with each MoE matrix kind's experts one parameter `[E, ...]` at its first expert's place: the step
    then runs them as one routed product (`llada_jax.model.moe.stacked_experts`), not a loop per expert. Only a
    bundle's own archive holds such a parameter (`write_archive`): the checkpoint's experts are not contiguous."""
    grouped: dict[str, list[Parameter]] = {}
    for parameter in layout.parameters:
        grouped.setdefault(expert_stack(parameter.name, config) or parameter.name, []).append(parameter)
    stacks = {name: tuple(p.name for p in group) for name, group in grouped.items() if name != group[0].name}
    parameters = [Parameter(name, (len(group), *group[0].shape), group[0].dtype) if name in stacks else group[0]
                  for name, group in grouped.items()]
    return dataclasses.replace(layout, parameters=tuple(parameters), stacks=stacks)


def routed_experts(layout: WeightLayout, config: LLaDAConfig) -> bool:
    """Every expert matrix stacked and multiplied by our kernels: the step runs a kind's experts as one routed call
    (`llada_jax.model.moe.stacked_experts`), with no loop over experts or their tiles. Stacked resident in the
    bundle's own archive (`with_stacked_experts`), or streamed: the ring reads a kind's experts back to back."""
    if layout.stacks:
        members = [key for keys in layout.stacks.values() for key in keys]
    elif layout.streamed:
        members = [p.name for p in layout.parameters if expert_stack(p.name, config) is not None]
    else:
        return False
    return bool(members) and all(key.rsplit(".", 1)[0] in layout.kernels for key in members)


def with_expert_bytes(layout: WeightLayout, config: LLaDAConfig) -> WeightLayout:
    """`layout` with each 4-bit expert matrix that no kernel of ours takes declared as its bytes `[O, I / 2]` int8,
    two values each, low nibble first (the step splits them, `llada_jax.quant.qlinear.split_nibbles`): IREE 3.13
    fails to compile an expert sliced out of an int4 stack (a masked i4 load it cannot legalize)."""
    def as_bytes(parameter: Parameter) -> Parameter:
        module = parameter.name.removesuffix(".weight_packed")
        scheme = layout.quantized.get(module)
        if (module == parameter.name or module in layout.kernels or scheme is None or scheme.bits != 4
                or expert_stack(parameter.name, config) is None):
            return parameter
        rows, columns = parameter.shape
        if (scheme.group_size or columns) % 2:  # a byte would straddle two groups
            return parameter
        return Parameter(parameter.name, (rows, columns // 2), "int8")
    return dataclasses.replace(layout, parameters=tuple(map(as_bytes, layout.parameters)))


def write_archive(files: list[Path], out: Path, quantized: dict[str, QuantScheme],
                  stacks: dict[str, tuple[str, ...]]) -> None:
    """The tensors of safetensors `files` as one IREE parameter archive (`.irpa`), each entry aligned so that a CPU
    device can map it in place: float tensors byte for byte, the packed integers of `quantized` modules signed
    (the offset removed: one xor of every value's sign bit). Each tensor is an entry of its own name, except those
    of `stacks`, each stack one entry of its tensors back to back. Stacks are written into their entries after
    the archive (a zero page placeholder before), one tensor in memory at a time."""
    import iree.runtime as rt

    stored, index = rt.ParameterIndex(), rt.ParameterIndex()
    for file in files:
        stored.load(str(file))
    entries = dict(stored.items())
    stacked = {key for keys in stacks.values() for key in keys}
    for name, entry in entries.items():
        if name not in stacked:
            index.add_buffer(name, _held(name, entry, quantized))
    for stack, keys in stacks.items():
        index.add_buffer(stack, np.zeros(sum(entries[key].length for key in keys), np.uint8))  # zero pages: no RSS
    written = index.create_archive_file(str(out))
    offsets = {name: entry.file_storage[1] for name, entry in written.items() if name in stacks}
    del written, index  # the archive's mapping
    with open(out, "r+b") as archive:
        for stack, keys in stacks.items():
            archive.seek(offsets[stack])
            for key in keys:
                archive.write(_held(key, entries[key], quantized))


def _held(name: str, entry, quantized: dict[str, QuantScheme]) -> memoryview:
    """A stored tensor's bytes as the archive holds them."""
    module = name.removesuffix(".weight_packed")
    if module != name and module in quantized:
        return (np.frombuffer(entry.file_view, np.uint32) ^ SIGN_BITS[quantized[module].bits]).data
    return entry.file_view


SIGN_BITS = {4: np.uint32(0x88888888), 8: np.uint32(0x80808080)}  # each packed value's sign bit, per int32 word
