"""The revision side path of an IREE dense path on a GPU: XLA on the host CPU, driven on a worker thread.

The accelerator runs the dense window steps; the host recomputes stale K/V and re-scores tokens with
the same weights (read once per session from the bundle's safetensors). The KV snapshot crosses to the
host when a job is submitted; refreshed K/V cross back at the merge.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from llada_jax.backends.xla import JaxBackend
from llada_jax.model import kv_state
from llada_jax.model.readout import StepOutput
from llada_jax.weights.checkpoint import load_params
from llada_jax.weights.quant_config import quantized_modules
from policies.backend import SideBackend


def host_side_backend(backend, weights_dir: Path) -> SideBackend:
    """An XLA side backend for an `IreeBackend`; its params are loaded once and kept on the session."""
    session = backend.session
    manifest = backend.bundle.manifest
    dtype = manifest["compute_dtype"]
    if session.host_params is None:  # a bundle's directory has no config.json: its manifest holds the quantization
        quantized = quantized_modules(manifest["model_config"], backend.config)
        session.host_params = load_params(weights_dir, backend.config, dtype, manifest["activations"],
                                          quantized=quantized)
    host = JaxBackend(session.host_params, backend.config, backend.readout_spec, backend.biases,
                      dtype=jnp.float32 if dtype == "float32" else jnp.bfloat16)

    def to_side(kv: kv_state.KVState) -> kv_state.KVState:
        return kv._replace(keys=jnp.asarray(session.read(kv.keys)), values=jnp.asarray(session.read(kv.values)))

    def to_dense(out: StepOutput) -> StepOutput:
        return StepOutput(out.readout, np.asarray(out.keys), np.asarray(out.values))

    return SideBackend(host, to_side, to_dense)
