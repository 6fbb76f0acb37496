"""Which of our kernels multiplies a quantized matrix (no JAX: the bundle builder asks too)."""

from __future__ import annotations

from typing import Literal, get_args

Kernels = Literal["own", "compiler"]  # our kernels where they apply, or XLA's / IREE's code
KERNELS: tuple[str, ...] = get_args(Kernels)
BLOCK = 32  # the kernels' activation block: the columns and every scale group are whole blocks
SCHEMES = {(4, "int8"): "w4a8", (4, "float"): "w4a16", (8, "int8"): "w8a8"}


def scheme_for(bits: int, activations: str, columns: int, group: int) -> str | None:
    """The kernel for `bits`-bit weights with `columns` inputs in scale groups of `group` and `activations`
    ("int8" or "float"); None where none takes it (XLA's or IREE's code then runs it)."""
    if columns % BLOCK or group % BLOCK or columns % group:
        return None
    return SCHEMES.get((bits, activations))
