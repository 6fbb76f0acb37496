"""The public Python interface: `load`, `logits`, `generate`. All input is validated here, on the host,
before any jitted step runs (JAX would silently clamp a bad index)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from llada_jax.backend import JaxBackend
from llada_jax.buckets import bucket
from llada_jax.checkpoint import compute_dtype, load_params
from llada_jax.config import LLaDAConfig, read_config
from llada_jax.decoding import check_token_ids, run_generation
from llada_jax.errors import LladaError
from llada_jax.params import hf_shapes
from llada_jax.readout import Readout, TokenBiases
from llada_jax.staged_backend import StagedJaxBackend
from llada_jax.staging import StagedWeights, StagingStats, kv_bytes, pack_weights, ring_slots
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

    @property
    def jnp_dtype(self):
        return compute_dtype(self.dtype)

    @property
    def weight_bytes(self) -> int:
        return sum(int(np.prod(s)) for s in hf_shapes(self.config).values()) * jnp.dtype(self.jnp_dtype).itemsize

    def backend(self, readout: Readout, biases: TokenBiases, cfg_scale: float, batch: int, slots: int):
        """The XLA backend for one generation, resident or staged, checked against the memory budget."""
        itemsize = jnp.dtype(self.jnp_dtype).itemsize
        kv = kv_bytes(self.config, batch, slots, itemsize)
        if self.staged is not None:
            ring = ring_slots(self.device_memory_budget, self.staged, kv)
            return StagedJaxBackend(self.staged, self.config, readout, biases, cfg_scale, ring, StagingStats(),
                                    self.jnp_dtype)
        if self.device_memory_budget is not None and self.weight_bytes + kv > self.device_memory_budget:
            raise LladaError(f"resident weights ({self.weight_bytes} bytes) plus the KV state ({kv} bytes) exceed "
                             f"the device memory budget {self.device_memory_budget}; load with a smaller budget "
                             "to stage the weights, or shorten the canvas")
        return JaxBackend(self.params, self.config, readout, biases, cfg_scale, self.jnp_dtype)


def load(path, dtype: str = "float32", device_memory_budget: int | None = None, check_weights: bool = False) -> Model:
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
    model = Model(config, None, tokenizer, dtype, model_dir, device_memory_budget)
    if device_memory_budget is not None and model.weight_bytes > device_memory_budget:
        staged = pack_weights(iter_tensors(model_dir, config), config, np.dtype(model.jnp_dtype))
        return dataclasses.replace(model, staged=staged)
    return dataclasses.replace(model, params=load_params(model_dir, config, dtype))


def logits(model: Model, ids) -> np.ndarray:
    """Full-canvas forward: float32 logits `[B, L, E]` for token ids `[B, L]` (the mask id is allowed)."""
    ids = check_token_ids(ids, model.config, "ids", allow_mask=True)
    if ids.ndim != 2:
        raise LladaError(f"ids must have shape [batch, length], got {list(ids.shape)}")
    batch, length = ids.shape
    if length > model.config.max_sequence_length:
        raise LladaError(f"length {length} exceeds max_sequence_length={model.config.max_sequence_length}")
    slots = bucket(length, model.config.max_sequence_length)
    padded = np.full((batch, slots), model.config.mask_token_id, np.int32)
    padded[:, :length] = ids
    valid = np.broadcast_to(np.arange(slots) < length, padded.shape)
    backend = model.backend(Readout(kind="logits"), TokenBiases.build(model.config.embedding_size), 0.0, batch, slots)
    return np.asarray(backend.full(padded, valid).readout["logits"][:, :length], np.float32)


def generate(model: Model, prompt_ids, **options):
    """Generate after `prompt_ids` with a decoder policy (see `decoding.run_generation` for the options:
    gen_length, block_length, steps, temperature, cfg_scale, remasking, policy, threshold, seed,
    logits_eos_inf, confidence_eos_eot_inf, on_step). Returns a `policies.decode.Result`."""

    return run_generation(model.backend, model.config, prompt_ids, **options)
