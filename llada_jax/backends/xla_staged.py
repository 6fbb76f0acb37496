"""The XLA backend in staged form: per-layer jitted steps whose weights stream through a StagingRing
(`staging.staged_forward` over the XLA device adapter below). Same numbers as `JaxBackend`
(tests/test_staging.py checks both)."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike

from llada_jax.backends.xla import DeviceRows, commit_on_device, empty_on_device, to_host
from llada_jax.model import kv_state
from llada_jax.model.config import LLaDAConfig
from llada_jax.model.layered import head_chunk_step, layer_step
from llada_jax.model.readout import ReadoutSpec, Reads, StepOutput, TokenBiases, chunk_biases
from llada_jax.staging.packing import head_chunks
from llada_jax.staging.swap import (
    StagedWeights,
    StagingRing,
    StagingStats,
    staged_full,
    staged_window,
)
from llada_jax.weights.loading import stage_on_device
from policies.backend import Backend


@dataclasses.dataclass(frozen=True)
class StagedJaxBackend(DeviceRows, Backend):
    weights: StagedWeights
    config: LLaDAConfig
    readout_spec: ReadoutSpec
    biases: TokenBiases
    cfg_scale: float
    buffers: int               # staging buffers in device memory
    stats: StagingStats
    dtype: DTypeLike = jnp.float32
    held: tuple[dict, ...] | None = None  # every stage already on the device (a layered model's)

    @functools.cached_property
    def _ring(self) -> StagingRing:
        """One ring per generation: its pinned stages are copied once, on first use (held ones never)."""
        return StagingRing(self.weights.stages, self.buffers, self._upload, self.stats,
                           dict(enumerate(self.held or ())))

    @functools.cached_property
    def _chunk_extras(self) -> list[tuple]:
        """The per-generation arguments of each head chunk, uploaded once."""
        scale = jnp.float32(self.cfg_scale)
        return [(scale, jnp.asarray(part.logit_bias), jnp.asarray(part.confidence_bias))
                for part in chunk_biases(self.biases, *head_chunks(self.config))]

    def _upload(self, buffer: int, stage: int) -> dict:
        """One stage to the device (XLA owns the device buffers, so `buffer` needs no address)."""
        return stage_on_device(self.weights, stage)

    # The device adapter of `staging.staged_forward`.
    def embed(self, rows: np.ndarray):
        return jnp.asarray(rows)

    def layer(self, tensors: dict, x, positions, key_bias, state, layer: int):
        cached = (None, None) if state is None else (state.keys[layer], state.values[layer])
        x, k, v = layer_step(tensors, x, jnp.asarray(positions, jnp.int32), jnp.asarray(key_bias), *cached,
                             config=self.config, quantization=self.weights.quantization[layer])
        x.block_until_ready()  # the ring times compute per stage
        return x, k, v

    def head(self, tensors: dict, x, chunk: int):
        quantization = self.weights.quantization[self.config.n_layers + chunk]
        return to_host(head_chunk_step(tensors, x, *self._chunk_extras[chunk], config=self.config,
                                       readout_spec=self.readout_spec, quantization=quantization))

    def stack(self, per_layer: list):
        return jnp.stack(per_layer)

    # The backend.
    def full(self, tokens: np.ndarray, valid: np.ndarray, reads: Reads | None = None) -> StepOutput:
        return staged_full(self, self._ring, self.weights, self.config, tokens, valid, reads)

    def window(self, state: kv_state.KVState, visible, window_ids, window_pos, window_valid,
               reads: Reads | None = None, blocks=None) -> StepOutput:
        return staged_window(self, self._ring, self.weights, self.config, state, visible, window_ids, window_pos,
                             window_valid, reads, blocks)

    def block_windows(self) -> bool:
        return True

    def commit(self, state, positions, write, out: StepOutput, tokens, nfe: int):
        return commit_on_device(state, positions, write, out, tokens, nfe)

    def empty_state(self, batch: int, slots: int):
        return empty_on_device(self.config, batch, slots, self.dtype)

    def staging_stats(self) -> dict:
        return self.stats.as_dict()
