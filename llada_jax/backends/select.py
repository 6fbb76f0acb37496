"""What runs a generation: the one place a backend is chosen, for the Python API, the bundle runner and the
CLI. A source of weights is a loaded model (XLA: device-resident params, or host-packed stages when the
weights exceed its device memory budget) or an open bundle (IREE: its program streams weights under a budget
itself, `lowering.stage_ring`).

No JAX at import: a bundle runs without it. The XLA parts are imported when a model is run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from llada_jax.backends.iree import Bundle, IreeBackend, Session, check_readout, load_bundle, window_refusal
from llada_jax.staging.swap import StagingStats, kv_bytes, ring_buffers
from llada_jax.system.errors import LladaError
from policies.backend import Backend, BackendRequest, SideBackend

DRIVERS = {"iree-host": "local-task", "iree-vulkan": "vulkan"}


@dataclasses.dataclass(frozen=True)
class OpenBundle:
    """A bundle loaded on its device."""

    bundle: Bundle
    session: Session

    @property
    def config(self):
        return self.bundle.config


def open_bundle(path, backend: str = "iree-host") -> OpenBundle:
    """Load and check a bundle and open it on the driver its target needs (`backend` must agree)."""
    bundle = load_bundle(path)
    wanted = DRIVERS.get(backend, bundle.manifest["driver"])
    if bundle.manifest["driver"] != wanted:
        raise LladaError(f"bundle {path} targets {bundle.manifest['target']} ({bundle.manifest['driver']}), "
                         f"which --backend {backend} cannot run")
    session = Session(bundle.path, bundle.manifest, bundle.manifest["driver"])
    return OpenBundle(bundle, session)


def select_backend(source, request: BackendRequest) -> Backend:
    """The backend that runs one generation of `source` (a `llada_jax.weights.loading.Model` or an `OpenBundle`),
    sized for the request's rows and canvas positions and checked against the device memory budget."""
    if isinstance(source, OpenBundle):
        return _iree_backend(source, request)
    return _xla_backend(source, request)


def check_request(source, request: BackendRequest, window_widths: tuple[int, ...] = ()) -> None:
    """Refuse, before a generation is queued, what the backend of `source` would refuse once it runs: a bundle
    reads out the argmax only, holds one block length's steps and the window widths it was compiled with
    (`window_widths`: those the decoder is known to need). A loaded model runs any request."""
    if not isinstance(source, OpenBundle):
        return
    _check_block_length(source, request)
    check_readout(request.readout_spec, request.cfg_scale)
    missing = sorted(set(window_widths) - set(source.bundle.window_widths))
    if missing:
        raise window_refusal(source.bundle, missing[-1], request.slots)


def _check_block_length(opened: OpenBundle, request: BackendRequest) -> None:
    compiled = opened.bundle.manifest.get("block_length")
    if compiled is not None and request.block_length not in (None, compiled):
        raise LladaError(f"this bundle holds the block steps of --block-length {compiled}, not "
                         f"{request.block_length} (llada compile --block-length {request.block_length})")


def _iree_backend(opened: OpenBundle, request: BackendRequest) -> Backend:
    _check_block_length(opened, request)
    return IreeBackend(opened.bundle, opened.session, request.readout_spec, request.biases, request.cfg_scale,
                       _host_side_path(opened))


def _host_side_path(opened: OpenBundle):
    """Revision's side path under an IREE dense path, made when revision asks for it: XLA on the host's CPU,
    on its own thread, when the dense path runs elsewhere (a GPU) and JAX is installed. Inline on the IREE
    backend otherwise: without JAX (a phone's runtime), and where the dense path runs on the host's cores
    itself, since XLA there would only take turns with it on the same cores while the K/V crosses between
    the two (README: inline took 0.59x the threaded time on the embedded model, 0.94x at the bench size)."""
    if opened.session.on_host_cpu:
        return None

    def side(backend: IreeBackend) -> SideBackend | None:
        try:
            from llada_jax.backends.host_side_path import (
                host_side_backend,  # imports JAX
            )
        except ImportError:
            return None
        return host_side_backend(backend, _weights_dir(opened.bundle))

    return side


def _weights_dir(bundle: Bundle) -> Path:
    """The directory holding the bundle's safetensors files (the bundle, or the model it links to)."""
    first = Path(bundle.manifest["weights"]["files"][0])
    return first.parent if first.is_absolute() else bundle.path


def _xla_backend(model, request: BackendRequest) -> Backend:
    from llada_jax.backends import xla, xla_staged  # imports JAX

    readout_spec, biases, cfg_scale = request.readout_spec, request.biases, request.cfg_scale
    kv = kv_bytes(model.config, request.rows, request.slots, model.itemsize)
    staged = model.staged
    if staged is not None and not model.layered:
        buffers = ring_buffers(model.device_memory_budget, staged, kv)
        return xla_staged.StagedJaxBackend(staged, model.config, readout_spec, biases, cfg_scale, buffers,
                                           StagingStats(), model.jnp_dtype)
    if model.device_memory_budget is not None and model.weight_bytes + kv > model.device_memory_budget:
        raise LladaError(f"resident weights ({model.weight_bytes} bytes) plus the KV state ({kv} bytes) exceed "
                         f"the device memory budget {model.device_memory_budget}; load with a smaller budget "
                         "to stage the weights, or shorten the canvas")
    if staged is not None:  # layered: every stage pinned, held resident, never streamed
        return xla_staged.StagedJaxBackend(staged, model.config, readout_spec, biases, cfg_scale,
                                           len(staged.stages), StagingStats(), model.jnp_dtype, model.device_stages)
    return xla.JaxBackend(model.params, model.config, readout_spec, biases, cfg_scale, model.jnp_dtype, model.mesh)

