"""The XLA backend in staged form: per-layer jitted steps whose weights stream through a StagingRing.
Same backend interface and same numbers as `JaxBackend` (tests/test_staging.py checks both)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from llada_jax import kv_state
from llada_jax.backend import _to_host, commit_on_device, empty_on_device
from llada_jax.config import LLaDAConfig
from llada_jax.layered import head_chunk_step, key_bias, layer_step
from llada_jax.packing import head_chunks, head_layout, layer_layout
from llada_jax.readout import Readout, StepOutput, TokenBiases, chunk_biases, combine_head_chunks
from llada_jax.staging import StagedWeights, StagingRing, StagingStats


@dataclasses.dataclass(frozen=True)
class StagedJaxBackend:
    weights: StagedWeights
    config: LLaDAConfig
    readout: Readout
    biases: TokenBiases
    cfg_scale: float
    slots: int                 # staging slots in device memory
    stats: StagingStats
    dtype: object = jnp.float32

    def _forward(self, ids: np.ndarray, positions: np.ndarray, bias: np.ndarray, state) -> StepOutput:
        x = jnp.asarray(self.weights.embedding[np.asarray(ids)])
        positions, bias = jnp.asarray(positions, jnp.int32), jnp.asarray(bias)
        keys, values, parts = [], [], []
        n = self.config.n_layers

        def compute(stage: int, weights: dict) -> None:
            nonlocal x
            if stage < n:
                cached = (None, None) if state is None else (state.keys[stage], state.values[stage])
                x, k, v = layer_step(weights, x, positions, bias, *cached, config=self.config)
                x.block_until_ready()
                keys.append(k)
                values.append(v)
            else:
                parts.append(_to_host(head_chunk_step(weights, x, *self._common[stage - n], config=self.config,
                                                      readout=self.readout)))

        self._ring.run(compute)
        out = combine_head_chunks(parts, head_chunks(self.config)[1], self.config.embedding_size)
        return StepOutput(out, jnp.stack(keys), jnp.stack(values))

    @functools.cached_property
    def _ring(self) -> StagingRing:
        """One ring per generation: its pinned stages are copied once, on first use."""
        return StagingRing(self.weights.stages, self.slots, self._upload, self.stats)

    @functools.cached_property
    def _common(self) -> list[tuple]:
        """The per-generation arguments of each head chunk, uploaded once."""
        scale = jnp.float32(self.cfg_scale)
        return [(scale, jnp.asarray(part.logit_bias), jnp.asarray(part.confidence_bias))
                for part in chunk_biases(self.biases, *head_chunks(self.config))]

    def _upload(self, slot: int, stage: int) -> dict:
        """One stage to the device, tensor by tensor from its packed host buffer. XLA owns the device
        buffers: on a CPU device `device_put` aliases the aligned host views (nothing is copied), so
        the real slot copies are the IREE runtime's (`lowering.staged_runtime`)."""
        layout = layer_layout(self.config) if stage < self.config.n_layers else head_layout(self.config)
        return {name: jax.device_put(view) for name, view in layout.views(self.weights.stages[stage]).items()}

    def full(self, tokens: np.ndarray, valid: np.ndarray) -> StepOutput:
        positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
        return self._forward(tokens, positions, key_bias(valid), None)

    def window(self, state: kv_state.KVState, visible, window_ids, window_pos, window_valid) -> StepOutput:
        bias = np.concatenate([kv_state.visible_bias(state, visible), key_bias(window_valid)], axis=1)
        return self._forward(window_ids, window_pos, bias, state)

    def commit(self, state, positions, write, out: StepOutput, tokens, step: int):
        return commit_on_device(state, positions, write, out, tokens, step)

    def empty_state(self, batch: int, slots: int):
        return empty_on_device(self.config, batch, slots, self.dtype)
