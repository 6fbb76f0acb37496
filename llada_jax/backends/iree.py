"""Run a compiled bundle with IREE: numpy + iree.runtime only (no JAX, no compiler), as on a phone.

Weights are bound once from the bundle's safetensors file(s) as named parameters; the KV state lives
in device buffers that steps read and `commit` writes; only argmax + log-probability come back to
the host each step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import numpy as np

from llada_jax.model import kv_state
from llada_jax.model.config import LLaDAConfig
from llada_jax.model.readout import Readout, ReadoutSpec, Reads, StepOutput, TokenBiases, first_columns, head_rows_for
from llada_jax.model.shapes import kv_shape
from llada_jax.system.errors import LladaError
from lowering.bundle_format import MANIFEST, PARAMETER_SCOPE, VMFB, StepSpec, check_files
from policies.backend import Backend, SideBackend
from policies.block_loop_io import BlockLoopInputs, BlockLoopOutputs, BlockLoopSpec
from policies.loop_io import LoopInputs, LoopOutputs, LoopSpec

HOST_CPU_DRIVERS = ("local-task", "local-sync")  # IREE's drivers that run compiled code on the host's own cores


class Session:
    """An IREE context with the bundle's functions and weights loaded, on one device."""

    def __init__(self, bundle_dir: Path, manifest: dict, driver: str):
        import iree.runtime as rt

        try:
            config = rt.Config(driver)
        except Exception as err:  # IREE raises plain RuntimeErrors for missing drivers
            raise LladaError(f"IREE driver {driver!r} is not available here ({str(err).splitlines()[0]})") from None
        self.device = config.device
        self.on_host_cpu = driver in HOST_CPU_DRIVERS
        self.vulkan = driver == "vulkan"
        self.host_params = None  # XLA copy of the weights for the revision side path, loaded on first use
        index = rt.ParameterIndex()
        for file in manifest["weights"]["files"]:
            path = Path(file) if Path(file).is_absolute() else bundle_dir / file
            if not path.is_file():
                raise LladaError(f"bundle weights file {path} is missing")
            index.load(str(path))
        instance = config.vm_instance
        params = rt.create_io_parameters_module(instance, index.create_provider(scope=PARAMETER_SCOPE))
        hal = rt.create_hal_module(instance, self.device)
        self.module = rt.VmModule.mmap(instance, str(bundle_dir / VMFB))
        self.context = rt.VmContext(instance, modules=[hal, params, self.module])
        self._invokers: dict[str, Callable] = {}
        self._rt = rt

    def invoker(self, name: str):
        if name not in self._invokers:
            function = self.module.lookup_function(name)
            if function is None:
                raise LladaError(f"the bundle has no step {name}")
            self._invokers[name] = self._rt.FunctionInvoker(self.context, self.device, function)
        return self._invokers[name]

    def upload(self, array: np.ndarray):
        return self._rt.asdevicearray(self.device, np.ascontiguousarray(array))

    def read(self, device_array) -> np.ndarray:
        """Copy a device array to host memory. On Vulkan through a mapped staging buffer: IREE's own
        read-back imports a numpy allocation, which Vulkan refuses unless page-aligned in address and size."""
        if not self.vulkan:  # a copy: to_host() can map the device buffer, which a later call may reuse
            return np.array(device_array.to_host(), copy=True)
        rt = self._rt
        view = device_array._buffer_view
        source = view.get_buffer()
        staging = self.device.allocator.allocate_buffer(
            memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
            allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
            allocation_size=source.byte_length())
        semaphore = self.device.create_semaphore(0)
        self.device.queue_copy(source, staging, wait_semaphores=rt.HalFence.create_at(semaphore, 0),
                               signal_semaphores=rt.HalFence.create_at(semaphore, 1))
        rt.HalFence.create_at(semaphore, 1).wait()
        dtype = rt.HalElementType.map_to_dtype(view.element_type)
        return np.array(staging.map().asarray(tuple(view.shape), dtype))

    def call(self, name: str, *args):
        return self.invoker(name)(*args)


@dataclasses.dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: dict
    config: LLaDAConfig

    @property
    def steps(self) -> set[str]:
        return {step["name"] for step in self.manifest["steps"]}

    @property
    def window_widths(self) -> list[int]:
        """The widths of its window steps, narrowest first."""
        return sorted({step["width"] for step in self.manifest["steps"] if step["kind"] == "window"})


def load_bundle(path, expected_target: str | None = None) -> Bundle:
    """Read and check a bundle: format, IREE runtime version, target, file checksums."""
    from importlib.metadata import version

    bundle_dir = Path(path)
    manifest_path = bundle_dir / MANIFEST
    if not manifest_path.is_file():
        raise LladaError(f"{bundle_dir} is not a bundle (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LladaError(f"{manifest_path} is not valid JSON") from None
    if not isinstance(manifest, dict):
        raise LladaError(f"{manifest_path} is not a bundle manifest (not a JSON object)")
    runtime_version = version("iree-base-runtime")
    if manifest.get("iree_version") != runtime_version:
        raise LladaError(f"bundle was compiled with IREE {manifest.get('iree_version')} but this runtime is "
                         f"{runtime_version}; recompile it")
    if expected_target is not None and manifest.get("target") != expected_target:
        raise LladaError(f"bundle targets {manifest.get('target')!r}, not {expected_target!r}")
    check_files(bundle_dir, manifest)
    config = LLaDAConfig.from_hf_dict(manifest["model_config"], eot_token_id=manifest.get("eot_token_id"))
    return Bundle(bundle_dir, manifest, config)


def check_readout(readout_spec: ReadoutSpec, cfg_scale: float) -> None:
    """A bundle's steps end in the argmax: a decoder reading anything else is refused."""
    if readout_spec != ReadoutSpec(kind="argmax") or cfg_scale != 0.0:
        raise LladaError("IREE bundles read out the argmax only: use temperature 0, cfg-scale 0 and "
                         "low_confidence remasking without top-k / top-p (Dream checkpoints: --top-k 0)")


def window_refusal(bundle: Bundle, width: int, slots: int) -> LladaError:
    """The error for a decoder needing window steps of `width` positions that `bundle` was not compiled with."""
    return LladaError(f"the decoder needs a window of {width} positions on a canvas of {slots}, and this bundle's "
                      f"windows are {bundle.window_widths or 'none'} wide: compile it with --window {width} or more, "
                      "or run a decoder with narrower windows (a smaller --block-length, no lookahead)")


class IreeBackend(Backend):
    """`policies.backend.Backend` over a bundle's compiled steps. `side`: where revision's side path
    runs (the caller may offer XLA on the host; this module never imports JAX)."""

    def __init__(self, bundle: Bundle, session: Session, readout_spec: ReadoutSpec, biases: TokenBiases,
                 cfg_scale: float = 0.0, side: Callable[["IreeBackend"], SideBackend | None] | None = None):
        check_readout(readout_spec, cfg_scale)
        self.bundle, self.session, self.config = bundle, session, bundle.config
        self.readout_spec, self.biases, self._side = readout_spec, biases, side
        # Uploaded once per generation; every step passes the same device buffers.
        self._extras = (np.asarray(cfg_scale, np.float32), session.upload(biases.logit_bias),
                        session.upload(biases.confidence_bias))

    def _call(self, name: str, *args):
        return self.session.call(name, *args)

    def full(self, tokens: np.ndarray, valid: np.ndarray, reads: Reads | None = None) -> StepOutput:
        batch, slots = tokens.shape
        out = self._call(StepSpec("full", batch, slots).name, tokens.astype(np.int32), valid.astype(np.int32))
        return self._output(out, batch, slots, reads)

    def window(self, state: kv_state.KVState, visible, window_ids, window_pos, window_valid,
               reads: Reads | None = None, blocks=None) -> StepOutput:
        if blocks is not None:  # run_generation refuses this before any step (`block_windows`)
            raise LladaError("a bundle's window steps attend bidirectionally: windows of several diffusion blocks "
                             "run on XLA")
        batch, width = window_ids.shape
        name = StepSpec("window", batch, state.slots, width).name
        if name not in self.bundle.steps:
            raise window_refusal(self.bundle, width, state.slots)
        out = self._call(name, state.keys, state.values,
                         kv_state.visible_bias(state, visible), np.asarray(window_ids, np.int32),
                         np.asarray(window_pos, np.int32), np.asarray(window_valid, np.int32))
        return self._output(out, batch, width, reads)

    def _output(self, out, batch: int, rows: int, reads: Reads | None) -> StepOutput:
        """The readout of the step's hidden rows on the host, the LM head run only on the declared width
        covering `reads` (None: every row), and the step's K/V."""
        head_rows = head_rows_for(reads, rows)
        x0, logp = self._call(StepSpec("read", batch, rows, head_rows.size).name, out[0], head_rows, *self._extras)
        readout = Readout(x0=self.session.read(x0), logp=self.session.read(logp))
        return StepOutput(readout if reads is None else first_columns(readout, len(reads)), out[1], out[2])

    def commit(self, state: kv_state.KVState, positions, write, out: StepOutput, tokens, nfe: int):
        targets = kv_state.write_targets(state, positions, write)
        batch, width = targets.shape
        # The compiled commit is a gather + select into fresh buffers: the old state's arrays stay intact
        # (tests/test_lowering.py checks it, since IREE may otherwise update a device-array input in place).
        keys, values = self._call(StepSpec("commit", batch, state.slots, width).name, state.keys, state.values,
                                  targets, out.keys, out.values)
        return kv_state.with_writes(state, keys, values, targets, tokens, nfe)

    def side_backend(self) -> SideBackend | None:
        return self._side(self) if self._side is not None else None

    def batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes `llada compile --batch-sizes` compiled steps for."""
        return tuple(sorted({step["batch"] for step in self.bundle.manifest["steps"]
                             if step["kind"] == "full"}))

    def join_rows(self, arrays: list, axis: int):
        return np.concatenate([self._host(array) for array in arrays], axis=axis)

    def split_rows(self, array, parts: int, axis: int) -> list:
        return np.split(self._host(array), parts, axis=axis)  # one read of the device array for every part

    def _host(self, array) -> np.ndarray:
        return array if isinstance(array, np.ndarray) else self.session.read(array)

    def compiled_loop(self, spec: LoopSpec | BlockLoopSpec):
        """The bundle's compiled decode loop for `spec`, if `llada compile` baked one."""
        if spec.name not in {entry["name"] for entry in self.bundle.manifest.get("loops", [])}:
            return None
        session = self.session
        invoker = session.invoker(spec.name)
        outputs = BlockLoopOutputs if isinstance(spec, BlockLoopSpec) else LoopOutputs

        def run(inputs: LoopInputs | BlockLoopInputs) -> LoopOutputs | BlockLoopOutputs:
            out = invoker(*(np.asarray(value) for value in inputs))  # 0-d stays 0-d (ascontiguousarray makes it 1-d)
            return outputs(*(session.read(value) for value in out))

        return run

    def empty_state(self, batch: int, slots: int) -> kv_state.KVState:
        dtype = np.float32 if self.bundle.manifest["compute_dtype"] == "float32" else _bfloat16()
        zeros = np.zeros(kv_shape(self.config, batch, slots), dtype)
        records = kv_state.empty_records(batch, slots)
        return kv_state.KVState(self.session.upload(zeros), self.session.upload(zeros), records, records.copy())


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16
