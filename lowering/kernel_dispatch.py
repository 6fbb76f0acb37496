"""Our kernels inside IREE bundles (`llada_jax/kernels/c`), through IREE's custom dispatch support.

The mechanism: the step is exported with our kernels as XLA FFI custom calls (`llada_jax.kernels.xla`, the same
program XLA runs); the bundle builder rewrites each `stablehlo.custom_call @llada_*_matmul` and
`@llada_*_activations` into a `flow.dispatch` of one `stream.executable` whose functions call the kernels' dispatch
entry points (`c/iree_dispatch.c`), declared `hal.import.static` and linked from an object file compiled for the
bundle's target (`hal.executable.objects`). IREE keeps scheduling, threading (one workgroup per 64 weight rows or
8 activation blocks), buffers, the compiled loop and the parameter weights; only the quantized matmuls and their
activations' preparation are ours. Chosen over the other routes:
a plugin (`--executable_plugin`) would be a second file `run.sh` must find at run time, and a pattern that
IREE matches would need its transform dialect to recognise the dequantization, the fusion it cannot do."""

from __future__ import annotations

import re
import shutil
import sys
from collections import Counter
from pathlib import Path

from llada_jax.kernels.build import KERNEL_SOURCES, SOURCE_DIR, check_runs_here, compile_object, find_toolchain
from llada_jax.kernels.schemes import BLOCK
from llada_jax.quant.choice import KERNELS, Kernels
from llada_jax.system.errors import LladaError
from lowering.bundle_weights import WeightLayout
from lowering.targets import Target

DISPATCH_SOURCE = "iree_dispatch.c"
# Embedded ELF rules (IREE's custom dispatch samples): no libc, no TLS or globals needing relocation at load.
OBJECT_FLAGS = ("-O3", "-std=c11", "-ffreestanding", "-fPIC", "-fvisibility=hidden", "-fno-plt", "-fdata-sections",
                "-ffunction-sections", "-fno-stack-protector", "-Wall")
ROWS_PER_WORKGROUP = 64  # LLK_IREE_ROWS in c/iree_dispatch.c
BLOCKS_PER_WORKGROUP = 8  # LLK_IREE_BLOCKS: of the activations' preparation
EXECUTABLE = "llada_kernels"
CUSTOM_CALL = re.compile(
    r"^(?P<indent>\s*)(?P<result>%[\w#]+) = stablehlo\.custom_call @llada_(?P<kind>int8|float)(?P<routed>_routed)?"
    r"_matmul"
    r"\((?P<operands>[^)]*)\) \{mhlo\.backend_config = \{(?P<config>[^}]*)\}.*\} : "
    r"\((?P<types>[^)]*)\) -> (?P<result_type>tensor<[^>]*>)$", re.MULTILINE)
ACTIVATIONS_CALL = re.compile(
    r"^(?P<indent>\s*)(?P<result>%[\w#]+(?::\d+)?) = stablehlo\.custom_call @llada_(?P<kind>int8|float)_activations"
    r"\((?P<operand>%[\w#]+)\) \{mhlo\.backend_config = \{(?P<config>[^}]*)\}.*\} : "
    r"\((?P<type>tensor<[^>]*>)\) -> (?P<result_types>\(.*\)|tensor<[^>]*>)$", re.MULTILINE)


def kernel_compiler(tgt: Target, layout: WeightLayout, kernels: Kernels) -> list[str] | None:
    """The C compiler command that builds our kernels for `tgt`, when they are asked for and apply (a
    quantized checkpoint, a CPU target); None: IREE's code runs the matmuls (with a one-line note when only the
    compiler is missing)."""
    if kernels not in KERNELS:
        raise LladaError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "compiler" or not layout.quantized or tgt.kernels is None:
        return None
    command = target_compiler(tgt)
    if command is None:
        wanted = " or ".join(tgt.kernels.compilers or ("cc", "gcc", "clang"))
        print(f"llada: no C compiler for {tgt.name} ({wanted}) to build our kernels; the bundle runs IREE's "
              "code for its quantized matmuls", file=sys.stderr)
    return command


def target_compiler(tgt: Target) -> list[str] | None:
    """The first C compiler on PATH that builds for `tgt` (the host's own for the host), as a command prefix."""
    if tgt.kernels is None:
        return None
    if tgt.kernels.compilers is None:
        toolchain = find_toolchain()
        return [toolchain.cc] if toolchain else None
    return next((c.split() for c in tgt.kernels.compilers if shutil.which(c.split()[0])), None)


def target_objects(tgt: Target, compiler: list[str], out_dir: Path) -> dict[str, list[Path]]:
    """The kernels and their dispatch entry points compiled for `tgt`, by IREE executable format."""
    assert tgt.kernels is not None
    if tgt.kernels.compilers is None:  # the host's own
        check_runs_here(compiler[0], tgt.kernels.flags)
    command = [*compiler, *OBJECT_FLAGS, *tgt.kernels.flags]
    return {tgt.kernels.object_format: [compile_object(command, SOURCE_DIR / name, out_dir)
                                        for name in (*KERNEL_SOURCES, DISPATCH_SOURCE)]}


def kernels_manifest(tgt: Target, compiler: list[str] | None, layout: WeightLayout) -> dict:
    """What a bundle's manifest says of its quantized matmuls."""
    if not compiler or not layout.kernels:
        return {"kind": "compiler"}
    assert tgt.kernels is not None
    return {"kind": "own", "compiler": " ".join(compiler), "flags": list(tgt.kernels.flags),
            "matrices": dict(sorted(Counter(layout.kernels.values()).items()))}


def dims(tensor_type: str) -> list[int]:
    """`tensor<4x100xf32>` -> [4, 100]."""
    return [int(d) for d in tensor_type[len("tensor<"):-1].split("x")[:-1]]


def activation_shape(tensor_type: str) -> tuple[int, int]:
    """(positions, columns) of a kernel's activations, block-major `[I/32, R, 32]`."""
    blocks, positions, width = dims(tensor_type)
    return positions, blocks * width


def element_type(tensor_type: str) -> str:
    return tensor_type[len("tensor<"):-1].split("x")[-1]


def rewrite_custom_calls(module_text: str) -> tuple[str, int]:
    """`module_text` with each of our kernels' custom calls (the matmuls and the activations' preparation) a
    `flow.dispatch` to `@llada_kernels`, and how many."""
    count = 0

    def dispatch(match: re.Match) -> str:
        nonlocal count
        count += 1
        kind, indent, name = match["kind"] + (match["routed"] or ""), match["indent"], f"%llk{count}"
        types = [t.strip() for t in match["types"].split(",")]
        config = _config(match["config"])
        positions, columns = activation_shape(types[0])
        scale_type = types[-2] if match["routed"] else types[-1]
        *experts, rows, groups = dims(scale_type)  # a routed call's scales are stacked: [E, O, G]
        bits = int(config.get("bits", "4 : i64").split(" ")[0])
        indices = ([bits] if match["kind"] == "int8" else []) + experts + [
            positions, columns, rows, columns // groups, int(element_type(scale_type) == "bf16")]
        operands = [o.strip() for o in match["operands"].split(",")]
        return _flow_dispatch(indent, name, match["result"], kind, operands, types, indices, len(indices) - 3,
                              match["result_type"])

    def prepare(match: re.Match) -> str:
        nonlocal count
        count += 1
        kind, name, config = f"{match['kind']}_activations", f"%llk{count}", _config(match["config"])
        feature_major = config["feature_major"] == "true"
        positions, columns = dims(match["type"])[::-1] if feature_major else dims(match["type"])
        nibbles = [int(config["nibbles"] == "true")] if "nibbles" in config else []
        indices = [positions, columns, int(feature_major), *nibbles, columns // BLOCK]
        return _flow_dispatch(match["indent"], name, match["result"], kind, [match["operand"]], [match["type"]],
                              indices, len(indices) - 1, match["result_types"])

    module_text = CUSTOM_CALL.sub(dispatch, module_text)
    return ACTIVATIONS_CALL.sub(prepare, module_text), count


def _config(text: str) -> dict[str, str]:
    """A custom call's `mhlo.backend_config` items, `bits = 4 : i64` -> {"bits": "4 : i64"}."""
    return dict(item.split(" = ") for item in text.split(", "))


def _flow_dispatch(indent: str, name: str, result: str, kind: str, operands: list[str], types: list[str],
                   indices: list[int], workload: int, result_types: str) -> str:
    """`result = flow.dispatch` of export `kind` on `operands` then `indices` as index constants, its workload
    the index at `workload`."""
    lines = [f"{indent}{name}_{i} = arith.constant {value} : index" for i, value in enumerate(indices)]
    arguments = ", ".join(operands + [f"{name}_{i}" for i in range(len(indices))])
    lines.append(f"{indent}{result} = flow.dispatch @{EXECUTABLE}::@{kind}[{name}_{workload}]({arguments}) : "
                 f"({', '.join(types + ['index'] * len(indices))}) -> {result_types}")
    return "\n".join(lines)


def executable(objects: dict[str, list[Path]]) -> str:
    """The `stream.executable` whose exports (`EXPORTS`) call the kernels, linking `objects` (IREE executable
    format, as `embedded-elf-x86_64`, -> object files)."""
    keyed = ",\n".join(f'      #hal.executable.target<"llvm-cpu", "{fmt}"> = ['
                       + ", ".join(f'#hal.executable.object<{{path = "{path}"}}>' for path in paths) + "]"
                       for fmt, paths in objects.items())
    return "\n".join([f"  stream.executable private @{EXECUTABLE} attributes {{",
                      "    hal.executable.objects = #hal.executable.objects<{", keyed, "    }>", "  } {",
                      *(_export(kind, EXPORTS[kind][2]) for kind in EXPORTS), "    builtin.module {",
                      *(_function(kind, *EXPORTS[kind][:2]) for kind in EXPORTS), "    }", "  }"])


# Each export's buffers (name, element type), index operands and workgroup size, in the C entry point's order
# (`c/iree_dispatch.c`); the routed ones take stacked experts and each expert's first row (`c/routed.c`). A
# matmul's workgroups split its weight rows, a preparation's its activations' blocks.
INT8_BUFFERS = (("values", "i8"), ("block_scales", "f32"), ("sums", "i32"), ("weights", "i8"), ("scales", "i8"))
FLOAT_BUFFERS = (("ordered", "f32"), ("weights", "i8"), ("scales", "i8"))
STARTS, OUT = ("starts", "i32"), ("out", "f32")
INDICES = ("positions", "columns", "rows", "group", "scale_bf16")
PREPARED = ("positions", "columns", "feature_major")
EXPORTS = {"int8": ((*INT8_BUFFERS, OUT), ("bits", *INDICES), ROWS_PER_WORKGROUP),
           "float": ((*FLOAT_BUFFERS, OUT), INDICES, ROWS_PER_WORKGROUP),
           "int8_routed": ((*INT8_BUFFERS, STARTS, OUT), ("bits", "experts", *INDICES), ROWS_PER_WORKGROUP),
           "float_routed": ((*FLOAT_BUFFERS, STARTS, OUT), ("experts", *INDICES), ROWS_PER_WORKGROUP),
           "int8_activations": ((("x", "f32"), *INT8_BUFFERS[:3]), (*PREPARED, "nibbles", "blocks"),
                                BLOCKS_PER_WORKGROUP),
           "float_activations": ((("x", "f32"), FLOAT_BUFFERS[0]), (*PREPARED, "blocks"), BLOCKS_PER_WORKGROUP)}


def _export(kind: str, per_workgroup: int) -> str:
    """The workgroup count: one per `per_workgroup` of the dispatch's workload."""
    return "\n".join([
        f"    stream.executable.export public @{kind} workgroups(%workload: index) -> (index, index, index) {{",
        f"      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {per_workgroup})>()[%workload]",
        "      %c1 = arith.constant 1 : index",
        "      stream.return %x, %c1, %c1 : index, index, index",
        "    }"])


def _function(kind: str, buffers: tuple, indices: tuple[str, ...]) -> str:
    """The exported function: each binding as a 1-D memref of its elements, then the C entry point's call."""
    c_types = ", ".join([f"memref<?x{element}>" for _, element in buffers] + ["index"] * (len(indices) + 1))
    bindings = ", ".join(f"%{name}: !stream.binding" for name, _ in buffers)
    operands = ", ".join(f"%{name}: index" for name in indices)
    lines = [f"      func.func private @llk_iree_{kind}({c_types}) attributes {{hal.import.static}}",
             f"      func.func @{kind}({bindings}, {operands}) {{",
             *(f"        {line}" for line in (_prepared_sizes(kind) if kind.endswith("_activations") else
                                               _sizes(kind))),
             "        %workgroup = hal.interface.workgroup.id[0] : index"]
    lines += [f"        %{name}_m = stream.binding.subspan %{name}[%c0] : !stream.binding -> "
              f"memref<?x{element}>{{%{name}_size}}" for name, element in buffers]
    arguments = ", ".join([f"%{name}_m" for name, _ in buffers] + [f"%{name}" for name in indices] + ["%workgroup"])
    lines += [f"        func.call @llk_iree_{kind}({arguments}) : ({c_types}) -> ()", "        return", "      }"]
    return "\n".join(lines)


def _prepared_sizes(kind: str) -> list[str]:
    """Each binding's element count in an activations' preparation."""
    lines = ["%c0 = arith.constant 0 : index", "%x_size = arith.muli %positions, %columns : index"]
    if kind.startswith("float"):
        return lines + ["%ordered_size = arith.addi %x_size, %c0 : index"]
    return lines + ["%values_size = arith.addi %x_size, %c0 : index",
                    "%block_scales_size = arith.muli %positions, %blocks : index",
                    "%sums_size = arith.addi %block_scales_size, %c0 : index"]


def _sizes(kind: str) -> list[str]:
    """Each binding's element count, from the index operands (a routed call's weights and scales: the stack's)."""
    lines = [*(f"%c{n} = arith.constant {n} : index" for n in (0, 1, 2, 4, 8, 32)),
             "%blocks = arith.divui %columns, %c32 : index",
             "%groups = arith.divui %columns, %group : index",
             "%is_bf16 = arith.cmpi ne, %scale_bf16, %c0 : index",
             "%scale_bytes = arith.select %is_bf16, %c2, %c4 : index",
             "%rows_groups = arith.muli %rows, %groups : index",
             "%matrix_scale_bytes = arith.muli %rows_groups, %scale_bytes : index",
             "%out_size = arith.muli %positions, %rows : index",
             "%activations_size = arith.muli %positions, %columns : index",
             "%rows_columns = arith.muli %rows, %columns : index"]
    bits = "%bits" if kind.startswith("int8") else "%c4"
    lines += [f"%weight_bits = arith.muli %rows_columns, {bits} : index",
              "%matrix_bytes = arith.divui %weight_bits, %c8 : index"]
    if kind.endswith("_routed"):
        lines += ["%starts_size = arith.addi %experts, %c1 : index",
                  "%weights_size = arith.muli %matrix_bytes, %experts : index",
                  "%scales_size = arith.muli %matrix_scale_bytes, %experts : index"]
    else:
        lines += ["%weights_size = arith.addi %matrix_bytes, %c0 : index",
                  "%scales_size = arith.addi %matrix_scale_bytes, %c0 : index"]
    if kind.startswith("float"):
        return lines + ["%ordered_size = arith.addi %activations_size, %c0 : index"]
    return lines + ["%values_size = arith.addi %activations_size, %c0 : index",
                    "%block_scales_size = arith.muli %positions, %blocks : index",
                    "%sums_size = arith.addi %block_scales_size, %c0 : index"]
