"""What runs a step. Decoders and policies call a backend and never know whether XLA or IREE is behind it.

A backend is built for one model, one readout and one CFG scale. Readouts come back to the host as
numpy (argmax + log-probability, or logits); proposed K/V stay on the device until committed.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from llada_jax import kv_state
from llada_jax.config import LLaDAConfig
from llada_jax.steps import Readout, full_step, window_step


@dataclasses.dataclass(frozen=True)
class StepOutput:
    readout: dict        # numpy: {"x0", "logp"} or {"logits"}, rows [B', W]
    keys: object         # proposed K [N, B, W, K, hd] (device)
    values: object       # proposed V [N, B, W, K, hd] (device)


@dataclasses.dataclass(frozen=True)
class JaxBackend:
    """Runs the jitted steps with XLA. Params are already device arrays; nothing is re-uploaded per step."""

    params: dict
    config: LLaDAConfig
    readout: Readout
    cfg_scale: float = 0.0
    dtype: object = jnp.float32

    def full(self, tokens: np.ndarray, valid: np.ndarray) -> StepOutput:
        out, keys, values = full_step(self.params, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid),
                                      jnp.float32(self.cfg_scale), config=self.config, readout=self.readout)
        return StepOutput(_to_host(out), keys, values)

    def window(self, state: kv_state.KVState, visible: np.ndarray, window_ids: np.ndarray,
               window_pos: np.ndarray, window_valid: np.ndarray) -> StepOutput:
        context = kv_state.context(state, visible)
        out, keys, values = window_step(
            self.params, context, jnp.asarray(window_ids, jnp.int32), jnp.asarray(window_pos, jnp.int32),
            jnp.asarray(window_valid), jnp.float32(self.cfg_scale), config=self.config, readout=self.readout)
        return StepOutput(_to_host(out), keys, values)

    def empty_state(self, batch: int, slots: int) -> kv_state.KVState:
        return kv_state.empty_state(self.config, batch, slots, self.dtype)


def _to_host(out: dict) -> dict:
    return {name: np.asarray(value) for name, value in out.items()}
