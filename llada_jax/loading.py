"""A model loaded from an HF LLaDA directory: config, tokenizer, and its weights either device-resident
(the params pytree) or, when they exceed the device memory budget, packed per stage on the host for
staged execution."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from llada_jax.checkpoint import compute_dtype, load_params
from llada_jax.config import LLaDAConfig, read_config
from llada_jax.errors import LladaError
from llada_jax.params import hf_shapes
from llada_jax.staging import StagedWeights, pack_weights
from llada_jax.tokenizer import Tokenizer, eot_id_from_files, load_tokenizer
from llada_jax.weights_io import check_finite_weights, iter_tensors


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: device-resident `params`, or, when its weights exceed the device memory budget,
    `staged` host-packed stages streamed through device memory at every step (params is then None)."""

    config: LLaDAConfig
    params: dict | None
    tokenizer: Tokenizer | None
    dtype: str = "float32"
    path: Path | None = None
    device_memory_budget: int | None = None
    staged: StagedWeights | None = None
    activations: str = "float"  # "int8": W8A8 matmuls for per-channel int8 weights (see qlinear)

    @property
    def jnp_dtype(self):
        return compute_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.jnp_dtype).itemsize

    @property
    def weight_bytes(self) -> int:
        return sum(int(np.prod(s)) for s in hf_shapes(self.config).values()) * self.itemsize


def load(path, dtype: str = "float32", device_memory_budget: int | None = None, check_weights: bool = False,
         activations: str = "float") -> Model:
    """Load an HF LLaDA directory (config.json + safetensors weights [+ tokenizer files]). With a device
    memory budget smaller than the weights, they are packed per layer on the host for staged execution.
    `check_weights` first scans every tensor for NaN/Inf (a pass over all weights)."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise LladaError(f"model directory {model_dir} does not exist")
    compute_dtype(dtype)
    if device_memory_budget is not None and device_memory_budget <= 0:
        raise LladaError(f"device memory budget must be a positive number of bytes, got {device_memory_budget}")
    tokenizer = load_tokenizer(model_dir)
    eot = eot_id_from_files(model_dir)
    if eot is None and tokenizer is not None:
        eot = tokenizer.token_id("<|eot_id|>")
    config = read_config(model_dir, eot_token_id=eot)
    if check_weights:
        check_finite_weights(model_dir, config)
    model = Model(config, None, tokenizer, dtype, model_dir, device_memory_budget, activations=activations)
    if device_memory_budget is not None and model.weight_bytes > device_memory_budget:
        staged = pack_weights(iter_tensors(model_dir, config), config, np.dtype(model.jnp_dtype))
        return dataclasses.replace(model, staged=staged)
    return dataclasses.replace(model, params=load_params(model_dir, config, dtype, activations))
