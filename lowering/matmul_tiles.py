"""Tile sizes for IREE's x86 AVX-512 code generation of float32 matmuls, given to iree-compile as a tuning spec.

A feature-major step multiplies `W [M, K] @ h [K, N]` (`llada_jax.layout`). IREE 3.13 tiles such a matmul
into 64 x 64 workgroups holding an 8 x 16 block of the output in registers (8 of the 32 vector registers).
Holding 8 x 32 (16 registers) and giving each workgroup 64 x 32 ran the bench-size products 17-39% faster
(README, "IREE at the bench size"). Tiles split only M and N, never K: every output is summed over K in the
same order as before, so a tuned bundle computes bit for bit what an untuned one does.
"""

from __future__ import annotations

import re
from pathlib import Path

WORKGROUP = (64, 32)   # output rows x columns one workgroup computes
REGISTERS = (8, 32)    # output rows x columns held in vector registers (8 x 2 zmm accumulators)

# The 2-D float32 products of an exported StableHLO module, `[M, K] x [K, N] -> [M, N]`.
_MATMUL = re.compile(r"stablehlo\.dot_general [^:\n]*contracting_dims = \[1\] x \[0\](?:, precision = [^:\n]*)? : "
                     r"\(tensor<(\d+)x(\d+)xf32>, tensor<(\d+)x(\d+)xf32>\)")


def host_has_avx512(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU compiling for `--iree-llvmcpu-target-cpu=host` has AVX-512 (32 zmm registers).
    The tiles above assume it: on AVX2's 16 registers the 8 x 32 block would spill."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and " avx512f" in line for line in text.splitlines())


def tunable_matmuls(module_text: str) -> list[tuple[int, int, int]]:
    """The distinct `(M, K, N)` of the module's float32 matmuls the register block divides (M by 8, N by 32);
    others keep IREE's own tiles."""
    shapes = {(int(m), int(k), int(n)) for m, k, k2, n in _MATMUL.findall(module_text) if k == k2}
    return sorted((m, k, n) for m, k, n in shapes if m % REGISTERS[0] == 0 and n % REGISTERS[1] == 0)


def tuning_spec(shapes: list[tuple[int, int, int]]) -> str:
    """A transform-dialect library (`--iree-codegen-tuning-spec-path`) giving each `linalg.matmul` of these
    float32 shapes the tiles above."""
    matchers = [_matcher(index, shape) for index, shape in enumerate(shapes)]
    pairs = ", ".join(f"@match_{index} -> @apply" for index in range(len(shapes)))
    return "\n".join([
        "module @llada_matmul_tiles attributes {transform.with_named_sequence, "
        "iree_codegen.tuning_spec_with_default_entrypoint} {",
        "  transform.named_sequence @apply(%op: !transform.any_op {transform.readonly}, "
        "%config: !transform.any_param {transform.readonly}) {",
        '    transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param',
        "    transform.yield",
        "  }",
        *matchers,
        "  transform.named_sequence @__kernel_config(%variant: !transform.any_op {transform.consumed}) -> "
        "!transform.any_op attributes {iree_codegen.tuning_spec_entrypoint} {",
        f"    %done = transform.foreach_match in %variant {pairs} : (!transform.any_op) -> !transform.any_op",
        "    transform.yield %done : !transform.any_op",
        "  }",
        "}",
    ])


def _matcher(index: int, shape: tuple[int, int, int]) -> str:
    m, k, n = shape
    config = ("#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
              f"distribution = [{WORKGROUP[0]}, {WORKGROUP[1]}, 0], "
              f"vector_common_parallel = [{REGISTERS[0]}, {REGISTERS[1]}, 0], vector_reduction = [0, 0, 1]>, "
              "translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")
    return "\n".join([
        f"  transform.named_sequence @match_{index}(%op: !transform.any_op {{transform.readonly}}) -> "
        "(!transform.any_op, !transform.any_param) {",
        '    transform.match.operation_name %op ["linalg.matmul"] : !transform.any_op',
        "    %lhs = transform.get_operand %op[0] : (!transform.any_op) -> !transform.any_value",
        "    %rhs = transform.get_operand %op[1] : (!transform.any_op) -> !transform.any_value",
        f"    transform.iree.match.cast_compatible_type %lhs = tensor<{m}x{k}xf32> : !transform.any_value",
        f"    transform.iree.match.cast_compatible_type %rhs = tensor<{k}x{n}xf32> : !transform.any_value",
        f"    %config = transform.param.constant {config} -> !transform.any_param",
        "    transform.yield %op, %config : !transform.any_op, !transform.any_param",
        "  }",
    ])
