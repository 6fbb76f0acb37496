"""The public Python interface: `load`, `logits`, `generate`. All input is validated here, on the host,
before any jitted step runs (JAX would silently clamp a bad index)."""

from __future__ import annotations

import functools

import numpy as np

from llada_jax.backends.select import select_backend
from llada_jax.model.readout import ReadoutSpec, TokenBiases
from llada_jax.model.shapes import bucket
from llada_jax.system.errors import LladaError
from llada_jax.weights.loading import Model, load
from policies.backend import BackendRequest
from policies.block_diffusion import block_logits
from policies.generation import check_token_ids, run_generation

__all__ = ["Model", "generate", "load", "logits"]


def logits(model: Model, ids, block_length: int | None = None, context_ids=None) -> np.ndarray:
    """Full-canvas forward: float32 logits `[B, L, E]` for token ids `[B, L]` (the mask id is allowed). A
    block-causal model (LLaDA2) needs `block_length`: its attention sees the own block and earlier ones; with
    `context_ids` `[B, L]`, each block of `ids` sees the earlier blocks of `context_ids` instead (a noised sequence
    against its clean one, as block diffusion's training bound reads it)."""
    _check_model(model)
    if block_length is not None and (isinstance(block_length, bool) or not isinstance(block_length, (int, np.integer))):
        raise LladaError(f"block_length must be an integer, got {block_length!r}")
    ids = check_token_ids(ids, model.config, "ids", allow_mask=True)
    if ids.ndim != 2:
        raise LladaError(f"ids must have shape [batch, length], got {list(ids.shape)}")
    if context_ids is not None:
        if block_length is None:
            raise LladaError("context_ids are the earlier blocks of a block-causal model: give block_length too")
        context_ids = check_token_ids(context_ids, model.config, "context_ids", allow_mask=True)
        if context_ids.shape != ids.shape:
            raise LladaError(f"context_ids must have the shape of ids {list(ids.shape)}, "
                             f"got {list(context_ids.shape)}")
    batch, length = ids.shape
    block_causal = model.config.block_causal
    if block_causal and (block_length is None or block_length < 1):
        raise LladaError("this model's attention is block-causal: give block_length (>= 1) to logits")
    if not block_causal and block_length is not None:
        raise LladaError(f"block_length is for block-causal models; {model.config.family} attends to every position")
    total = -(-length // block_length) * block_length if block_length else length
    if total > model.config.max_sequence_length:
        raise LladaError(f"length {total} exceeds max_sequence_length={model.config.max_sequence_length}")
    slots = bucket(total, model.config.max_sequence_length)
    request = BackendRequest(readout_spec=ReadoutSpec(kind="logits"), rows=batch, slots=slots,
                             biases=TokenBiases.build(model.config.embedding_size))
    backend = select_backend(model, request)
    if block_length is not None:
        return block_logits(backend, ids, block_length, model.config.mask_token_id, slots, context_ids)
    padded = np.full((batch, slots), model.config.mask_token_id, np.int32)
    padded[:, :length] = ids
    valid = np.broadcast_to(np.arange(slots) < length, padded.shape)
    return np.asarray(backend.full(padded, valid).readout.logits[:, :length], np.float32)


def generate(model: Model, prompt_ids, **options):
    """Generate after `prompt_ids` with a decoder policy. `options`: the fields of
    `policies.options.GenerationOptions` (gen_length, block_length and steps are required), plus `on_step` and
    `loop` (see `policies.generation.run_generation`). Returns a `policies.loop.Result`;
    for a batch of prompts (a list of sequences, or `[N, L]`), a list of them, each row as its prompt alone
    decodes."""
    _check_model(model)
    return run_generation(functools.partial(select_backend, model), model.config, prompt_ids, **options)


def _check_model(model) -> None:
    if not isinstance(model, Model):
        raise LladaError(f"expected a model from llada_jax.load, got {type(model).__name__}")
