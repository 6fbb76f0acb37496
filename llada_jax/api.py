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
from llada_jax.readout import Readout, TokenBiases
from llada_jax.steps import full_step
from llada_jax.tokenizer import Tokenizer, eot_id_from_files, load_tokenizer


@dataclasses.dataclass(frozen=True)
class Model:
    config: LLaDAConfig
    params: dict
    tokenizer: Tokenizer | None
    dtype: str = "float32"
    path: Path | None = None

    @property
    def jnp_dtype(self):
        return compute_dtype(self.dtype)


def load(path, dtype: str = "float32") -> Model:
    """Load an HF LLaDA directory (config.json + safetensors weights [+ tokenizer files])."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise LladaError(f"model directory {model_dir} does not exist")
    compute_dtype(dtype)
    tokenizer = load_tokenizer(model_dir)
    eot = eot_id_from_files(model_dir)
    if eot is None and tokenizer is not None:
        eot = tokenizer.token_id("<|eot_id|>")
    config = read_config(model_dir, eot_token_id=eot)
    params = load_params(model_dir, config, dtype)
    return Model(config, params, tokenizer, dtype, model_dir)


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
    neutral = TokenBiases.build(model.config.embedding_size)
    out, _, _ = full_step(model.params, jnp.asarray(padded), jnp.asarray(valid), jnp.float32(0.0),
                          jnp.asarray(neutral.logit_bias), jnp.asarray(neutral.confidence_bias),
                          config=model.config, readout=Readout(kind="logits"))
    return np.asarray(out["logits"][:, :length], np.float32)


def generate(model: Model, prompt_ids, **options):
    """Generate after `prompt_ids` with a decoder policy (see `decoding.run_generation` for the options:
    gen_length, block_length, steps, temperature, cfg_scale, remasking, policy, threshold, seed,
    logits_eos_inf, confidence_eos_eot_inf, on_step). Returns a `policies.decode.Result`."""

    def make_backend(readout, biases, cfg_scale):
        return JaxBackend(model.params, model.config, readout, biases, cfg_scale, model.jnp_dtype)

    return run_generation(make_backend, model.config, prompt_ids, **options)
