"""Which matmuls a quantized model runs: float or int8 activations, our kernels or the compiler's code, checked
against the checkpoint before any weight is read."""

from __future__ import annotations

import re
from typing import get_args

import jax

from llada_jax.kernels import xla as own_kernels
from llada_jax.kernels.schemes import BLOCK, KERNELS, Kernels
from llada_jax.quant.quantize import Activations
from llada_jax.system.errors import LladaError
from llada_jax.system.host_cpu import cpu_flags

ACTIVATIONS: tuple[str, ...] = get_args(Activations)

DECODER_LAYER = re.compile(r"\.(blocks|layers)\.\d+\.")  # a decoder layer's module, in any family's names


def check_activations(activations: object, quantized: dict, kernels: Kernels = "compiler") -> None:
    """int8 activations need quantized decoder layers: any with our kernels, int8 per-channel ones with XLA's
    code; anywhere else they would be ignored."""
    if activations not in ACTIVATIONS:
        raise LladaError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    if kernels not in KERNELS:
        raise LladaError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    blocks = [s for module, s in quantized.items() if DECODER_LAYER.search(module)]
    if activations != "int8":
        return
    if not blocks:
        raise LladaError("--activations int8 needs a quantized checkpoint (`llada quantize --bits 4|8`)")
    if kernels == "own":
        odd = sorted({s.group_size for s in blocks if (s.group_size or BLOCK) % BLOCK})
        if odd:
            raise LladaError(f"--activations int8 with our kernels needs scale groups of a multiple of 32 columns; "
                             f"this checkpoint's layers have groups of {odd[0]} (requantize with --group-size 32)")
    elif not all(s.matmul_activations("int8") == "int8" for s in blocks):
        raise LladaError("--activations int8 on 4-bit or group-wise layers needs our kernels (--kernels own, "
                         "with a C compiler); XLA's code takes int8 per-channel layers only")


def kernels_in_use(kernels: Kernels, quantized: dict, mesh=None, activations: Activations = "float",
                   dtype: str = "float32") -> Kernels:
    """"own" where our kernels can run this model's matmuls (a quantized checkpoint, one CPU device, the
    kernels built on this machine), else "compiler" (after a one-line note when the build is what failed).
    Float activations in bfloat16 steps on a CPU with bf16 dot products (avx512_bf16, amx_bf16) stay XLA's: its
    bf16 matmuls beat our float32 W4A16 there (eval/RESULTS.md, "Our kernels against llama.cpp")."""
    if kernels not in KERNELS:
        raise LladaError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "compiler" or not quantized or mesh is not None or jax.default_backend() != "cpu":
        return "compiler"
    if activations == "float" and dtype == "bfloat16" and BF16_DOT_FLAGS & cpu_flags():
        return "compiler"
    return "own" if own_kernels.available() else "compiler"


BF16_DOT_FLAGS = {"avx512_bf16", "amx_bf16"}
