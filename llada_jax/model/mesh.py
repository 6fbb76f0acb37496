"""Many devices, one engine: a `jax.sharding.Mesh` of this host's devices with two axes.

- `data`: the rows of a step (prompts of a batch) are split across its devices; weights are replicated.
- `model`: every decoder matrix is split across its devices (attention by heads, the MLP by its hidden
  units, the LM head by vocabulary), for weights one device cannot hold; XLA adds the collectives.

Sharding is layout only: XLA computes the same function whatever the layout, so a mesh changes where work
runs, never what it computes (float rounding may differ where the model axis splits a sum).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from llada_jax.system.errors import LladaError

DATA, MODEL = "data", "model"
# Which axis of a torch-layout `[out, in]` matrix the model axis splits: outputs of the projections into heads
# and hidden units, inputs of the projections back to d_model (one reduction each, Megatron-style).
_SPLIT_AXIS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "ff_proj": 0, "up_proj": 0, "attn_out": 1, "ff_out": 1,
               "lm_head": 0, "wte": 1}
_SPEC = re.compile(r"^(data|model)=(all|\d+)$")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """`--mesh data=N,model=M`: N (or `all` the devices left) on the data axis, M on the model axis."""

    data: int | None = None  # None: every local device the model axis leaves
    model: int = 1

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        sizes: dict[str, int | None] = {}
        for part in text.replace(" ", "").split(","):
            found = _SPEC.match(part)
            if not found or found.group(1) in sizes:
                raise LladaError(f"--mesh takes data=N|all,model=M (each at most once), got {text!r}")
            sizes[found.group(1)] = None if found.group(2) == "all" else int(found.group(2))
        if sizes.get(MODEL) is None and MODEL in sizes:
            raise LladaError("--mesh: model=all is not allowed; give the model axis a size")
        if any(size == 0 for size in sizes.values()):
            raise LladaError(f"--mesh axis sizes must be >= 1, got {text!r}")
        return cls(sizes.get(DATA), sizes.get(MODEL) or 1)

    def build(self, devices: list | None = None) -> Mesh:
        """The mesh over `devices` (default: this process's own devices, `jax.local_devices()`)."""
        devices = jax.local_devices() if devices is None else devices
        data = len(devices) // self.model if self.data is None else self.data
        if data < 1 or data * self.model > len(devices):
            raise LladaError(f"--mesh data={self.data or 'all'},model={self.model} needs "
                             f"{max(data, 1) * self.model} devices; this host has {len(devices)} "
                             f"({devices[0].platform})")
        grid = np.array(devices[: data * self.model]).reshape(data, self.model)
        return Mesh(grid, (DATA, MODEL))


def check_mesh(mesh) -> None:
    """A mesh given to `load` is one `MeshSpec.build` makes: a jax Mesh with the data and model axes."""
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (DATA, MODEL):
        raise LladaError(f"mesh must be a jax Mesh with axes ({DATA!r}, {MODEL!r}), as "
                         f"llada_jax.model.mesh.MeshSpec.parse('data=2').build() makes; got {mesh!r:.80}")


def check_fits_model_axis(config, mesh: Mesh) -> None:
    """The model axis splits attention by heads: its size must divide the query and K/V head counts."""
    size = mesh.shape[MODEL]
    if config.n_heads % size or config.n_kv_heads % size:
        raise LladaError(f"--mesh model={size} must divide the model's {config.n_heads} attention heads and "
                         f"{config.n_kv_heads} K/V heads")


def weight_sharding(name: str, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """Where tensor `name` (an HF short name: `q_proj`, `lm_head`, ...) of `shape` lives: split on the
    model axis along its `_SPLIT_AXIS` when that divides, else replicated (norms, scales)."""
    axis = _SPLIT_AXIS.get(name)
    size = mesh.shape[MODEL]
    if axis is None or size == 1 or len(shape) <= axis or shape[axis] % size:
        return NamedSharding(mesh, PartitionSpec())
    spec: list[str | None] = [None] * len(shape)
    spec[axis] = MODEL
    return NamedSharding(mesh, PartitionSpec(*spec))


def place_weight(array: np.ndarray, name: str, mesh: Mesh):
    """A host array of tensor `name` (or a part of it: a quantized weight's values or scales) on the mesh,
    straight into its shards (never whole on one device first)."""
    return jax.device_put(array, weight_sharding(name, np.shape(array), mesh))


def rows_sharding(mesh: Mesh, shape: tuple[int, ...], axis: int, heads_axis: int | None = None) -> NamedSharding:
    """Rows (axis `axis` of `shape`) split across the data axis when they divide evenly, else replicated
    (a step of fewer rows than data devices runs whole on each); attention heads (`heads_axis`) split across
    the model axis, as the steps compute them."""
    spec: list[str | None] = [None] * len(shape)
    if shape[axis] % mesh.shape[DATA] == 0:
        spec[axis] = DATA
    if heads_axis is not None and shape[heads_axis] % mesh.shape[MODEL] == 0:
        spec[heads_axis] = MODEL
    return NamedSharding(mesh, PartitionSpec(*spec))


def put_rows(array, mesh: Mesh, axis: int = 0):
    """A batch array (host or device) with its rows on the data axis (see `rows_sharding`)."""
    return jax.device_put(array, rows_sharding(mesh, np.shape(array), axis))


def put_kv(array, mesh: Mesh):
    """K or V `[N, B, S, K, hd]` (`llada_jax.model.shapes.kv_shape`): rows on the data axis, heads on the model axis."""
    return jax.device_put(array, rows_sharding(mesh, np.shape(array), axis=1, heads_axis=3))


def describe(mesh: Mesh) -> str:
    """`data=4 x model=1 over 4 cpu devices`."""
    devices = mesh.devices.flatten()
    return f"data={mesh.shape[DATA]} x model={mesh.shape[MODEL]} over {len(devices)} {devices[0].platform} devices"
