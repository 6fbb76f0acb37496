"""The revision side path of an IREE dense path: XLA on the host CPU, on a worker thread.

The accelerator runs the dense window steps; the host recomputes stale K/V and re-scores tokens with
the same weights (read once per session from the bundle's safetensors). The KV snapshot crosses to the
host when a job is submitted; refreshed K/V cross back at the merge. Without JAX installed (a phone
runtime), the side path runs inline on the IREE backend itself: same results, no overlap.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llada_jax import kv_state
from llada_jax.readout import StepOutput
from policies.side_path import SidePath


def weights_dir(bundle) -> Path:
    """The directory holding the bundle's safetensors files (the bundle, or the model it links to)."""
    first = Path(bundle.manifest["weights"]["files"][0])
    return first.parent if first.is_absolute() else bundle.path


def host_side_path(backend) -> SidePath:
    """An XLA side path for an `IreeBackend`; its params are cached on the session."""
    try:
        import jax.numpy as jnp

        from llada_jax.backend import JaxBackend
        from llada_jax.checkpoint import load_params
    except ImportError:
        return SidePath(backend, concurrent=False)
    session = backend.session
    dtype = backend.bundle.manifest["compute_dtype"]
    if getattr(session, "host_params", None) is None:
        session.host_params = load_params(weights_dir(backend.bundle), backend.config, dtype)
    host = JaxBackend(session.host_params, backend.config, backend.readout, backend.biases,
                      dtype=jnp.float32 if dtype == "float32" else jnp.bfloat16)

    def to_side(kv: kv_state.KVState) -> kv_state.KVState:
        return kv._replace(keys=jnp.asarray(session.read(kv.keys)), values=jnp.asarray(session.read(kv.values)))

    def to_dense(out: StepOutput) -> StepOutput:
        return StepOutput(out.readout, np.asarray(out.keys), np.asarray(out.values))

    return SidePath(host, concurrent=True, to_side=to_side, to_dense=to_dense)
