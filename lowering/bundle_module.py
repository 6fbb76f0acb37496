"""Export the bundle's functions with `jax.export` and merge them into one StableHLO module whose weights are
IREE named parameters (`#flow.parameter.named<"model"::"<HF tensor name>">`), never constants.

Each function is a flat `(weights..., inputs...) -> outputs` (`lowering.export`); a public wrapper named after it
loads every weight from its global and calls it. The runtime binds scope "model" to the checkpoint's own
safetensors file(s), so one weights file serves every target. Our kernels' custom calls become dispatches of
their executable (`lowering.kernel_dispatch`).
"""

from __future__ import annotations

import re

import jax
from jax import export

from llada_jax.kernels.xla import TARGETS as KERNEL_CALLS
from llada_jax.model.staged import TARGET as STAGE_CALL
from lowering.bundle_format import PARAMETER_SCOPE
from lowering.bundle_weights import WeightLayout
from lowering.export import Function, weight_structs
from lowering.kernel_dispatch import executable, rewrite_custom_calls
from lowering.stage_ring import group_of, rewrite_stage_calls, ring_parts, ring_plan

MLIR_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "i32", "bool": "i1", "int8": "i8",
              "int4": "i4"}


def mlir_type(sds: jax.ShapeDtypeStruct) -> str:
    dims = "".join(f"{d}x" for d in sds.shape)
    return f"tensor<{dims}{MLIR_TYPES[str(sds.dtype)]}>"


def export_function(function: Function, layout: WeightLayout) -> str:
    """StableHLO text of one function without debug locations; its entry is `@main`."""
    from iree.compiler import ir

    named = [weight_structs(layout)] if function.named_weights else []
    # our custom calls are rewritten for IREE below
    checks = [export.DisabledSafetyCheck.custom_call(name) for name in (*KERNEL_CALLS, STAGE_CALL)]
    exported = export.export(jax.jit(function.run, keep_unused=True), disabled_checks=checks)(
        *named, *[sds for _, sds in function.inputs])
    with ir.Context():  # pyright: ignore[reportAttributeAccessIssue] (native bindings without stubs)
        module = ir.Module.parse(exported.mlir_module())  # pyright: ignore[reportAttributeAccessIssue]
        return module.operation.get_asm(enable_debug_info=False)


def _body_with_prefix(module_text: str, prefix: str) -> str:
    """The functions inside an exported module, every symbol renamed `prefix + name` so modules merge."""
    symbols = re.findall(r"func\.func (?:public |private )?@([\w$.]+)", module_text)
    text = re.sub(r"@([\w$.]+)", lambda m: f"@{prefix}{m.group(1)}" if m.group(1) in symbols else m.group(0),
                  module_text)
    text = text.replace(f"func.func public @{prefix}main", f"func.func private @{prefix}main", 1)
    lines = text.strip().splitlines()
    assert lines[0].startswith("module") and lines[-1] == "}", "unexpected exported module layout"
    return "\n".join(lines[1:-1])


def _wrapper(function: Function, layout: WeightLayout, weight_globals: list[str | None]) -> str:
    """The public function: each weight loaded from its global (a streamed one, which the step reads itself, is
    an empty placeholder), then the step called."""
    weight_types = [mlir_type(sds) for sds in weight_structs(layout)]
    in_types = [mlir_type(sds) for _, sds in function.inputs]
    out_types = [mlir_type(sds) for _, sds in function.outputs]
    if not function.named_weights:
        weight_types = []
    name = function.name
    lines = [f"  func.func @{name}({', '.join(f'%a{i}: {t}' for i, t in enumerate(in_types))})"
             f" -> ({', '.join(out_types)}) {{"]
    lines += [f"    %w{i} = util.global.load @{g} : {t}" if g else f"    %w{i} = tensor.empty() : {t}"
              for i, (g, t) in enumerate(zip(weight_globals, weight_types))]
    call_args = [f"%w{i}" for i in range(len(weight_types))] + [f"%a{i}" for i in range(len(in_types))]
    call_types = weight_types + in_types
    lines.append(f"    %r:{len(out_types)} = func.call @{name}__main({', '.join(call_args)}) : "
                 f"({', '.join(call_types)}) -> ({', '.join(out_types)})")
    lines.append(f"    return {', '.join(f'%r#{i}' for i in range(len(out_types)))} : {', '.join(out_types)}")
    lines.append("  }")
    return "\n".join(lines)


def bundle_module(functions: list[Function], layout: WeightLayout, config, kernel_objects: dict | None = None) -> str:
    """One module holding every function, the weights declared once as named parameters (if a function reads
    them), except what a streamed layout streams (its layers, head and maybe embedding), which the program reads
    stage by stage (`lowering.stage_ring`); our kernels' calls dispatched to their executable, linking
    `kernel_objects` (`lowering.kernel_dispatch.executable`)."""
    declared = layout.parameters if any(function.named_weights for function in functions) else ()
    plan = ring_plan(layout, config) if layout.streamed and declared else None
    globals_ = [None if plan and group_of(p, layout, config) is not None else f"weight_{i}"
                for i, p in enumerate(declared)]
    parts = ["module @llada_steps {"]
    for g, parameter, sds in zip(globals_, declared, weight_structs(layout)):
        if g:
            parts.append(f'  util.global private @{g} = #flow.parameter.named<"{PARAMETER_SCOPE}"::'
                         f'"{parameter.name}"> : {mlir_type(sds)}')
    dispatches = 0
    for function in functions:
        body, count = rewrite_custom_calls(_body_with_prefix(export_function(function, layout), f"{function.name}__"))
        if plan:
            body, fetches = rewrite_stage_calls(body, plan, f"{function.name}__")
            parts += fetches
        dispatches += count
        parts += [body, _wrapper(function, layout, globals_)]
    if plan:
        parts[1:1] = ring_parts(plan)
    if dispatches:
        if not kernel_objects:
            raise ValueError("the steps call our kernels but no kernel objects were built for the target")
        parts.insert(1, executable(kernel_objects))
    parts.append("}")
    return "\n".join(parts)
