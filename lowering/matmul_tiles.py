"""Tile sizes for IREE's x86 code generation of float32 matmuls, given to iree-compile as a tuning spec.

A feature-major step multiplies `W [M, K] @ h [K, N]` (`llada_jax.model.layout`). Tiles split M and N and unroll the
sum over K, in order: every output is summed over K in the same order as before, so a tuned bundle computes
bit for bit what an untuned one does. The tiles depend on the vector registers of the CPU
compiling for `-target-cpu=host`:
- AVX-512 (32 zmm): IREE 3.13 tiles into 64 x 64 workgroups holding an 8 x 16 block of the output in
  registers. Holding 8 x 32 (16 registers) and giving each workgroup 64 x 32 ran the bench-size products
  17-39% faster (README, "IREE at the bench size").
- AVX2 (16 ymm): IREE 3.13 holds an 8 x 8 block (8 accumulators, one register wide). A 4 x 16 block (8
  accumulators, two registers wide) in 32 x 16 workgroups, the sum unrolled by 8, ran the bench-size
  model's 12 layers of products (cold weights, as in a step) faster on every width than the tiles before,
  32 x 32 workgroups walking the sum in blocks of 128 (AMD Zen 3, GFLOP/s, medians: on 32 columns
  88.6 -> 101.2, on 96 135 -> 140, on 192 112 -> 125; IREE's own tiles on 192: 82-85; README).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from llada_jax.system.host_cpu import CPUINFO, cpu_flags


class Tiles(NamedTuple):
    workgroup: tuple[int, int]  # output rows x columns one workgroup computes
    registers: tuple[int, int]  # output rows x columns held in vector registers
    sum_unroll: int = 1         # terms of the sum over K each step of the register loop adds, in order


AVX512_TILES = Tiles((64, 32), (8, 32))  # 8 x 2 zmm accumulators
AVX2_TILES = Tiles((32, 16), (4, 16), sum_unroll=8)  # 4 x 2 ymm accumulators

# The 2-D float32 products of an exported StableHLO module, `[M, K] x [K, N] -> [M, N]`.
_MATMUL = re.compile(r"stablehlo\.dot_general [^:\n]*contracting_dims = \[1\] x \[0\](?:, precision = [^:\n]*)? : "
                     r"\(tensor<(\d+)x(\d+)xf32>, tensor<(\d+)x(\d+)xf32>\)")


def host_tiles(cpuinfo: Path = CPUINFO) -> Tiles | None:
    """The tiles for the CPU compiling for `--iree-llvmcpu-target-cpu=host`: by its widest float32 FMA vectors
    (None: neither AVX-512 nor AVX2 with FMA, IREE's own tiles)."""
    flags = cpu_flags(cpuinfo)
    if "avx512f" in flags:
        return AVX512_TILES
    if {"avx2", "fma"} <= flags:
        return AVX2_TILES
    return None


def tunable_matmuls(module_text: str, tiles: Tiles | None) -> list[tuple[int, int, int]]:
    """The distinct `(M, K, N)` of the module's float32 matmuls the register block divides; others keep
    IREE's own tiles (no tiles: none)."""
    if tiles is None:
        return []
    shapes = {(int(m), int(k), int(n)) for m, k, k2, n in _MATMUL.findall(module_text) if k == k2}
    rows, columns = tiles.registers
    return sorted((m, k, n) for m, k, n in shapes if m % rows == 0 and n % columns == 0)


def tuning_spec(shapes: list[tuple[int, int, int]], tiles: Tiles) -> str:
    """A transform-dialect library (`--iree-codegen-tuning-spec-path`) giving each `linalg.matmul` of these
    float32 shapes `tiles`."""
    matchers = [_matcher(index, shape, tiles) for index, shape in enumerate(shapes)]
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


def _matcher(index: int, shape: tuple[int, int, int], tiles: Tiles) -> str:
    m, k, n = shape
    (group_rows, group_columns), (rows, columns), unroll = tiles
    config = ("#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
              f"distribution = [{group_rows}, {group_columns}, 0], "
              f"vector_common_parallel = [{rows}, {columns}, 0], vector_reduction = [0, 0, {unroll}]>, "
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
