"""The XLA backend (`policies.backend.Backend`): the jitted steps with device-resident params.
Readouts come back to the host as numpy; proposed K/V stay on the device until committed."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from numpy.typing import DTypeLike

from llada_jax.model import kv_state
from llada_jax.model.config import LLaDAConfig
from llada_jax.model.forward import Context
from llada_jax.model.mesh import put_kv, put_rows
from llada_jax.model.readout import ReadoutSpec, Reads, StepOutput, TokenBiases, first_columns, head_rows_for
from llada_jax.model.shapes import kv_shape
from llada_jax.model.steps import full_step, scatter_slots, window_step
from policies.backend import Backend
from policies.block_loop import block_loop
from policies.block_loop_io import BlockLoopInputs, BlockLoopOutputs, BlockLoopSpec
from policies.decode_loop import decode_loop
from policies.loop_io import LoopInputs, LoopOutputs, LoopSpec


class DeviceRows:
    """Batch rows of XLA device arrays joined and split on the device (`Backend.join_rows/split_rows`), in
    steps of power-of-two row counts: XLA compiles once per shape, and rows of a batch leave at different
    steps, so a free row count would compile a step for every count on the way down."""

    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(1 << power for power in range(13))

    def join_rows(self, arrays: list, axis: int):
        return jnp.concatenate(arrays, axis=axis)

    def split_rows(self, array, parts: int, axis: int) -> list:
        return jnp.split(array, parts, axis=axis)


@dataclasses.dataclass(frozen=True)
class JaxBackend(DeviceRows, Backend):
    """Runs the jitted steps with XLA. Params are device arrays already; nothing is re-uploaded per step."""

    params: dict
    config: LLaDAConfig
    readout_spec: ReadoutSpec
    biases: TokenBiases
    cfg_scale: float = 0.0
    dtype: DTypeLike = jnp.float32
    mesh: Mesh | None = None  # every step's rows split over its data axis (`llada_jax.model.mesh`)

    def _rows(self, array, axis: int = 0):
        """A batch array on the device: with a mesh, its rows (axis `axis`) split over the data axis."""
        return jnp.asarray(array) if self.mesh is None else put_rows(array, self.mesh, axis)

    def _kv(self, array):
        """K or V on the device: with a mesh, rows on the data axis and heads on the model axis."""
        return array if self.mesh is None else put_kv(array, self.mesh)

    @functools.cached_property
    def _common(self) -> tuple:
        """The per-generation step arguments, uploaded once (not on every step)."""
        return (jnp.float32(self.cfg_scale), jnp.asarray(self.biases.logit_bias),
                jnp.asarray(self.biases.confidence_bias))

    def full(self, tokens: np.ndarray, valid: np.ndarray, reads: Reads | None = None) -> StepOutput:
        out, keys, values = full_step(self.params, self._rows(np.asarray(tokens, np.int32)), self._rows(valid),
                                      *self._common, _head(reads, tokens.shape[1]), config=self.config,
                                      readout_spec=self.readout_spec)
        return StepOutput(_read_back(out, reads), keys, values)

    def window(self, state: kv_state.KVState, visible: np.ndarray, window_ids: np.ndarray,
               window_pos: np.ndarray, window_valid: np.ndarray, reads: Reads | None = None,
               blocks: np.ndarray | None = None) -> StepOutput:
        bias = self._rows(kv_state.visible_bias(state, visible))
        context = Context(self._kv(state.keys), self._kv(state.values), bias)
        out, keys, values = window_step(
            self.params, context, self._rows(np.asarray(window_ids, np.int32)),
            self._rows(np.asarray(window_pos, np.int32)), self._rows(window_valid), *self._common,
            _head(reads, np.shape(window_ids)[1]), None if blocks is None else self._rows(np.asarray(blocks, np.int32)),
            config=self.config, readout_spec=self.readout_spec)
        return StepOutput(_read_back(out, reads), keys, values)

    def block_windows(self) -> bool:
        return True

    def commit(self, state: kv_state.KVState, positions: np.ndarray, write: np.ndarray, out: StepOutput,
               tokens: np.ndarray, nfe: int) -> kv_state.KVState:
        return commit_on_device(state, positions, write, out, tokens, nfe)

    def empty_state(self, batch: int, slots: int) -> kv_state.KVState:
        state = empty_on_device(self.config, batch, slots, self.dtype)
        return state._replace(keys=self._kv(state.keys), values=self._kv(state.values))

    def compiled_loop(self, spec: LoopSpec | BlockLoopSpec):
        blocks = isinstance(spec, BlockLoopSpec)
        loop, inputs_type, outputs_type = ((block_loop, BlockLoopInputs, BlockLoopOutputs) if blocks
                                           else (decode_loop, LoopInputs, LoopOutputs))

        def run(inputs):
            out = loop(self.params, inputs_type(*(jnp.asarray(value) for value in inputs)), config=self.config,
                       spec=spec, kv_dtype=self.dtype)
            return outputs_type(*(np.asarray(value) for value in out))

        return run


def _head(reads: Reads | None, rows: int):
    """The steps' `rows` argument for `reads` of a step's `rows` (None: the head on every row)."""
    return None if reads is None else jnp.asarray(head_rows_for(reads, rows))


def _read_back(out, reads: Reads | None):
    """The step's readout on the host, cut to the columns `reads` asked for (the head ran on them padded)."""
    readout = to_host(out)
    return readout if reads is None else first_columns(readout, len(reads))


def commit_on_device(state: kv_state.KVState, positions, write, out: StepOutput, tokens, nfe: int):
    """The KV state with `out`'s proposed K/V written where `write` holds (XLA device arrays)."""
    targets = kv_state.write_targets(state, positions, write)
    device_targets = jnp.asarray(targets)
    keys = scatter_slots(state.keys, device_targets, out.keys)
    values = scatter_slots(state.values, device_targets, out.values)
    return kv_state.with_writes(state, keys, values, targets, tokens, nfe)


def empty_on_device(config: LLaDAConfig, batch: int, slots: int, dtype) -> kv_state.KVState:
    shape = kv_shape(config, batch, slots)
    records = kv_state.empty_records(batch, slots)
    return kv_state.KVState(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), records, records.copy())


def to_host(out):
    """A readout record with every device array copied to a numpy array."""
    return type(out)(*(None if value is None else np.asarray(value) for value in out))
