"""What loading a model will take, checked against the memory there is, before anything is read (no JAX).

The need is the weights in the form they will be held (the compute dtype for float tensors, integers
plus their scales for quantized ones, as the checkpoint stores them, resident or in host-packed stages), plus
a KV state and the working set of a full step over `PLAN_POSITIONS` positions (activations, attention scores,
logits, and one dequantized matrix for group-wise weights), plus the largest tensor as it is read. A model
that cannot fit is refused in one line naming the need and what would fit, before the OOM killer can
be the error message. `LLADA_HOST_MEMORY` (bytes) overrides the memory found.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.params import hf_shapes
from llada_jax.quant.quantize import QuantScheme
from llada_jax.system.errors import LladaError

PLAN_POSITIONS = 512
ENV_OVERRIDE = "LLADA_HOST_MEMORY"
GB = 1e9


@dataclasses.dataclass(frozen=True)
class MemoryNeed:
    weights: int
    working: int  # KV state + a step's working set + the read buffers

    @property
    def total(self) -> int:
        return self.weights + self.working


def weight_bytes(config: LLaDAConfig, itemsize: int, quantized: dict[str, QuantScheme], scale_itemsize: int = 4) -> int:
    """Bytes of every tensor as held for compute: float tensors at `itemsize`, quantized ones as integers
    (one byte, or half for 4 bits) plus their scales at `scale_itemsize`."""
    total = 0
    for name, shape in hf_shapes(config).items():
        scheme = quantized.get(name[: -len(".weight")])
        if scheme is None:
            total += math.prod(shape) * itemsize
        else:
            rows, columns = shape
            total += rows * columns * scheme.bits // 8 + rows * scheme.groups(columns) * scale_itemsize
    return total


def working_bytes(config: LLaDAConfig, itemsize: int, quantized: dict[str, QuantScheme],
                  positions: int = PLAN_POSITIONS) -> int:
    """A full step over `positions` positions (float32 upper bounds) plus a KV state for them."""
    shapes = hf_shapes(config)
    largest = max(math.prod(s) for s in shapes.values())
    kv = 2 * config.n_layers * positions * config.n_kv_heads * config.head_dim * itemsize
    activations = positions * (4 * config.d_model + 3 * config.mlp_hidden_size) * 4
    scores = config.n_heads * positions * positions * 4
    logits = positions * config.embedding_size * 4
    grouped = [math.prod(shapes[m + ".weight"]) for m, s in quantized.items() if s.group_size is not None]
    dequantized = max(grouped, default=0) * 4
    read_buffer = largest * 4  # the largest tensor as read, before it is converted
    return kv + activations + scores + logits + dequantized + read_buffer


def resident_need(config: LLaDAConfig, itemsize: int, quantized: dict[str, QuantScheme],
                  scale_itemsize: int = 4) -> MemoryNeed:
    return MemoryNeed(weight_bytes(config, itemsize, quantized, scale_itemsize),
                      working_bytes(config, itemsize, quantized))


def available_memory() -> int | None:
    """Bytes this process may still use: `LLADA_HOST_MEMORY` if set, else the smaller of the system's
    available memory and the cgroup's remaining limit; None where neither can be read."""
    override = os.environ.get(ENV_OVERRIDE)
    if override is not None:
        try:
            return int(override)
        except ValueError:
            raise LladaError(f"{ENV_OVERRIDE} must be a number of bytes, got {override!r}") from None
    found = [n for n in (_meminfo_available(), _cgroup_remaining()) if n is not None]
    return min(found) if found else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_remaining() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) - used


def check_fits(need: MemoryNeed, what: str, alternatives: list[tuple[str, MemoryNeed]],
               available: int | None = None) -> None:
    """Refuse, in one line, a `need` larger than `available` (default: the host's available memory),
    naming the alternatives that fit."""
    available = available_memory() if available is None else available
    if available is None or need.total <= available:
        return
    fitting = [f"{name} ({alt.total / GB:.1f} GB)" for name, alt in alternatives if alt.total <= available]
    hint = "; fits: " + ", ".join(fitting) if fitting else "; nothing smaller fits either"
    raise LladaError(f"{what} needs {need.total / GB:.1f} GB (weights {need.weights / GB:.1f} GB + KV state and "
                     f"working set {need.working / GB:.1f} GB) but {available / GB:.1f} GB is available{hint}")
