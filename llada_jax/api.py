"""The public Python interface: `load`, `logits`, `generate`. All input is validated here, on the host,
before any jitted step runs (JAX would silently clamp a bad index)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np

from llada_jax.backend import JaxBackend
from llada_jax.buckets import bucket
from llada_jax.checkpoint import compute_dtype, load_params
from llada_jax.config import LLaDAConfig, read_config
from llada_jax.errors import LladaError
from llada_jax.steps import Readout, full_step
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


def check_token_ids(ids: np.ndarray, config: LLaDAConfig, what: str, allow_mask: bool) -> np.ndarray:
    """Integer ids inside the vocabulary (and, for prompts, not the mask token)."""
    ids = np.asarray(ids)
    if ids.size == 0:
        raise LladaError(f"{what} is empty")
    if not np.issubdtype(ids.dtype, np.integer):
        raise LladaError(f"{what} must be integer token ids, got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= config.embedding_size)
    if bad.any():
        raise LladaError(f"{what} holds token id {int(ids[bad][0])} outside the vocabulary [0, {config.embedding_size})")
    if not allow_mask and (ids == config.mask_token_id).any():
        raise LladaError(f"{what} holds the mask token id {config.mask_token_id}")
    return ids.astype(np.int32)


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
    out, _, _ = full_step(model.params, jnp.asarray(padded), jnp.asarray(valid), jnp.float32(0.0),
                          config=model.config, readout=Readout(kind="logits"))
    return np.asarray(out["logits"][:, :length], np.float32)


def generate(model: Model, prompt_ids, *, gen_length: int, block_length: int, steps: int,
             temperature: float = 0.0, cfg_scale: float = 0.0, remasking: str = "low_confidence",
             policy: str = "vanilla", threshold: float | None = None, seed: int = 0,
             logits_eos_inf: bool = False, confidence_eos_eot_inf: bool = False,
             on_step: Callable | None = None):
    """Generate `gen_length` tokens after `prompt_ids` with a decoder policy; returns a `Result`."""
    from policies.decode import Schedule, decode, make_rule
    from policies.registry import make_cache_policy
    from policies.sampling import Sampler

    config = model.config
    prompt = check_token_ids(prompt_ids, config, "prompt", allow_mask=False)
    if prompt.ndim == 2 and prompt.shape[0] == 1:  # the reference's [1, L] prompt shape
        prompt = prompt[0]
    if prompt.ndim != 1:
        raise LladaError(f"prompt_ids must be one sequence [length], got shape {list(prompt.shape)}")
    schedule = Schedule(int(gen_length), int(block_length), int(steps))
    total = len(prompt) + schedule.gen_length
    if total > config.max_sequence_length:
        raise LladaError(f"prompt ({len(prompt)}) + gen_length ({schedule.gen_length}) = {total} exceeds "
                         f"max_sequence_length={config.max_sequence_length}")
    if not cfg_scale >= 0.0:
        raise LladaError(f"cfg_scale must be >= 0, got {cfg_scale}")
    cache_policy = make_cache_policy(policy)
    rule = make_rule(schedule, threshold)
    unconfident = config.special_ids_in_vocab(config.eos_token_id, config.eot_token_id) if confidence_eos_eot_inf else ()
    sampler = Sampler(float(temperature), remasking, unconfident)
    readout = Readout(kind=sampler.readout_kind, cfg=cfg_scale > 0.0,
                      forbid_ids=(config.eos_token_id,) if logits_eos_inf else (), unconfident_ids=unconfident)
    backend = JaxBackend(model.params, config, readout, float(cfg_scale), model.jnp_dtype)
    return decode(backend, prompt, schedule, cache_policy, rule, sampler, mask_id=config.mask_token_id,
                  max_len=config.max_sequence_length, cfg=cfg_scale > 0.0, seed=seed, on_step=on_step)
