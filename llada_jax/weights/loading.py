"""A model loaded from an HF LLaDA directory: config, tokenizer, and its weights either device-resident
(the params pytree) or, when they exceed the device memory budget, packed per stage on the host for
staged execution. A sparse model with more expert loops than XLA can compile in one step program is
packed per stage too and runs layer by layer with every stage resident (`layered_execution`)."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from llada_jax.model.config import LLaDAConfig, checked_model_dir, read_config
from llada_jax.model.mesh import MODEL, check_fits_model_axis, check_mesh
from llada_jax.model.moe import kernels_take_experts
from llada_jax.model.params import hf_shapes
from llada_jax.quant.choice import Kernels, check_activations, kernels_in_use
from llada_jax.quant.quantize import Activations, QuantScheme
from llada_jax.staging.swap import StagedWeights, pack_weights
from llada_jax.system.errors import LladaError
from llada_jax.system.host_memory import release_freed_memory
from llada_jax.weights.checkpoint import compute_dtype, load_params
from llada_jax.weights.memory_plan import check_fits, resident_need, weight_bytes
from llada_jax.weights.quant_config import default_group_size, planned_modules
from llada_jax.weights.tokenizer import Tokenizer, eot_id_from_files, load_tokenizer
from llada_jax.weights.weights_io import (
    check_finite_weights,
    check_names,
    checkpoint_quantization,
    iter_tensors,
    stored_scale_itemsize,
    weight_files,
)

LOAD_BAR_BYTES = 1 << 30  # a load that takes seconds or more shows a progress bar
# Beyond this many expert loops XLA's CPU compile of a whole step did not finish (eval/RESULTS.md, LLaDA2).
WHOLE_STEP_EXPERT_LOOPS = 2048


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: device-resident `params`, or, when its weights exceed the device memory budget,
    `staged` host-packed stages streamed through device memory at every step (params is then None).
    `layered`: the stages are all held resident and run one compiled layer piece at a time (`device_stages`: each
    stage's tensors on the device, put there once at load)."""

    config: LLaDAConfig
    params: dict | None
    tokenizer: Tokenizer | None
    dtype: str = "float32"
    path: Path | None = None
    device_memory_budget: int | None = None
    staged: StagedWeights | None = None
    activations: Activations = "float"  # "int8": int8 x int8 matmuls (W8A8, or W4A8 with our kernels; see qlinear)
    kernels: Kernels = "compiler"  # "own": our kernels run the quantized matmuls (`llada_jax.kernels`)
    quantized: dict = dataclasses.field(default_factory=dict)  # module -> QuantScheme of the checkpoint
    mesh: Mesh | None = None  # the params are sharded over it (`llada_jax.model.mesh`); None: one device
    scale_itemsize: int = 4  # bytes per quantization scale, held as the checkpoint stores them
    layered: bool = False
    device_stages: tuple[dict, ...] | None = None

    @property
    def jnp_dtype(self):
        return compute_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.jnp_dtype).itemsize

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.config, self.itemsize, self.quantized, self.scale_itemsize)


def load(path, dtype: str = "float32", device_memory_budget: int | None = None, check_weights: bool = False,
         activations: Activations = "float", mesh=None, kernels: Kernels = "own") -> Model:
    """Load an HF LLaDA directory (config.json + safetensors weights [+ tokenizer files]). With a device
    memory budget smaller than the weights, they are packed per layer on the host for staged execution.
    `check_weights` first scans every tensor for NaN/Inf (a pass over all weights). With a `mesh`
    (`llada_jax.model.mesh.MeshSpec(...).build()`), the weights are sharded over its model axis (replicated over
    its data axis) and every step's rows are split over its data axis."""
    if not isinstance(path, (str, os.PathLike)):
        raise LladaError(f"load takes a model directory's path, got {path!r}")
    model_dir = checked_model_dir(path)
    compute_dtype(dtype)
    if device_memory_budget is not None and (isinstance(device_memory_budget, bool)
                                             or not isinstance(device_memory_budget, (int, np.integer))):
        raise LladaError(f"device memory budget must be a number of bytes, got {device_memory_budget!r}")
    if device_memory_budget is not None and device_memory_budget <= 0:
        raise LladaError(f"device memory budget must be a positive number of bytes, got {device_memory_budget}")
    if mesh is not None:
        check_mesh(mesh)
    tokenizer = load_tokenizer(model_dir)
    eot = eot_id_from_files(model_dir)
    if eot is None and tokenizer is not None:
        eot = tokenizer.token_id("<|eot_id|>")
    config = read_config(model_dir, eot_token_id=eot)
    if check_weights:
        check_finite_weights(model_dir, config)
    quantized = checkpoint_quantization(model_dir, config)
    check_names(weight_files(model_dir), config, model_dir, quantized)  # a config that is not these weights' fails fast
    kernels = kernels_in_use(kernels, quantized, mesh, activations, dtype)
    check_activations(activations, quantized, kernels)
    model = Model(config, None, tokenizer, dtype, model_dir, device_memory_budget, activations=activations,
                  kernels=kernels, quantized=quantized, mesh=mesh,
                  scale_itemsize=stored_scale_itemsize(model_dir, quantized))
    staged = device_memory_budget is not None and model.weight_bytes > device_memory_budget
    stack = kernels_take_experts(config, quantized, kernels, activations)  # no loop per expert, staged or not
    layered = not staged and mesh is None and layered_execution(config) and not stack
    if layered:
        model = dataclasses.replace(model, layered=layered)
    if mesh is not None:
        check_fits_model_axis(config, mesh)
        if staged:
            raise LladaError("staged execution (--device-memory-budget) runs on one device; drop --mesh, or shard "
                             "the weights over a model axis (--mesh model=N) instead of staging them")
    check_memory(model, staged)
    bar = functools.partial(tqdm, total=len(hf_shapes(config)), desc=f"loading {model_dir.name}", unit="tensor",
                            file=sys.stderr, leave=False, disable=model.weight_bytes < LOAD_BAR_BYTES)
    if staged or layered:
        packed = pack_weights(bar(iter_tensors(model_dir, config)), config, np.dtype(model.jnp_dtype), activations,
                              kernels, stack)
        held = tuple(stage_on_device(packed, stage) for stage in range(len(packed.stages))) if layered else None
        model = dataclasses.replace(model, staged=packed, device_stages=held)
    else:
        model = dataclasses.replace(model, params=load_params(model_dir, config, dtype, activations, mesh, wrap=bar,
                                                                  kernels=kernels, stack_experts=stack))
    release_freed_memory()
    return model


def stage_on_device(staged: StagedWeights, stage: int) -> dict:
    """One stage's tensors on the device, each from its view of the packed host buffer: on a CPU device
    `device_put` aliases the aligned views (nothing is copied)."""
    return {name: jax.device_put(view) for name, view in staged.layouts[stage].views(staged.stages[stage]).items()}


def layered_execution(config: LLaDAConfig) -> bool:
    """Whether XLA runs this model layer by layer: a step program holding every sparse layer's expert loops
    would not compile in reasonable time and memory, so one piece per layer shape is compiled instead
    (`llada_jax.model.layered`), its weights resident all the same."""
    return config.n_experts * (config.n_layers - config.dense_layers) > WHOLE_STEP_EXPERT_LOOPS


def check_memory(model: Model, staged: bool) -> None:
    """Refuse, before reading any weight, a model the memory cannot hold (see `memory_plan`)."""
    config, itemsize, quantized = model.config, model.itemsize, model.quantized
    need = resident_need(config, itemsize, quantized, model.scale_itemsize)
    if staged and model.device_memory_budget is not None:  # host-packed stages, plus the staging buffers
        need = dataclasses.replace(need, working=need.working + min(model.device_memory_budget, need.weights))
    alternatives = []
    if model.dtype == "float32":
        alternatives.append(("--dtype bfloat16", resident_need(config, 2, quantized, model.scale_itemsize)))
    if not quantized:
        schemes = [QuantScheme(8)] + ([QuantScheme(4, group)] if (group := default_group_size(config)) else [])
        for scheme in schemes:
            alternatives.append((f"a checkpoint from `llada quantize --bits {scheme.bits}`",
                                 resident_need(config, itemsize, planned_modules(config, scheme))))
    mode = "staged" if staged else "resident"
    accelerator = accelerator_memory()
    if accelerator is not None and model.mesh is not None:  # each accelerator holds its model-axis share
        need = dataclasses.replace(need, weights=need.weights // model.mesh.shape[MODEL])
        mode += f", weights split over {model.mesh.shape[MODEL]} devices"
    check_fits(need, f"{model.path} ({model.dtype}, {mode})", alternatives, accelerator)


def accelerator_memory() -> int | None:
    """Free memory of the first accelerator (GPU/TPU), where the weights live; None on a CPU device,
    whose memory is the host's (checked instead)."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return None if limit is None else int(limit) - int(stats.get("bytes_in_use", 0))
