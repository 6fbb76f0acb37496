"""`llada compile`: export a model's steps, compile them for a target with IREE, write a bundle.

A bundle directory holds `manifest.json` (model config, every step's name/shapes/argument order,
target and flags, IREE version, sha256 of each file), `steps.vmfb`, the tokenizer files, and the
weights (a copy: a parameter archive on CPU targets, the safetensors files elsewhere; or a pointer to the
model's own files). It is written to a temporary directory and renamed into place, so a half-written bundle
never exists.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from llada_jax.families import host_loop_conventions
from llada_jax.model.config import checked_model_dir, read_config, read_hf_dict
from llada_jax.quant.choice import Kernels
from llada_jax.quant.quantize import Activations
from llada_jax.system.atomic import atomic_dir, check_output_dir
from llada_jax.system.errors import LladaError
from llada_jax.weights.checkpoint import compute_dtype
from llada_jax.weights.tokenizer import eot_id_from_files
from llada_jax.weights.weights_io import INDEX_FILE, weight_files
from lowering.bundle_format import (
    ARCHIVE,
    FORMAT_VERSION,
    MANIFEST,
    MANIFEST_DIGEST,
    TOKENIZER_FILES,
    VMFB,
    file_stamp,
    manifest_digest,
    sha256,
)
from lowering.bundle_layout import bundle_layout
from lowering.bundle_module import bundle_module
from lowering.bundle_weights import WeightLayout, routed_experts, write_archive
from lowering.export import (
    block_loop_function,
    canvas_sizes,
    loop,
    loop_manifest,
    signature_manifest,
    step,
    step_specs,
)
from lowering.kernel_dispatch import kernels_manifest, target_objects
from lowering.matmul_tiles import tunable_matmuls, tuning_spec
from lowering.run_script import write_run_script
from lowering.stage_ring import byte_size, resident_bytes, ring_plan
from lowering.targets import compile_flags, target, target_tiles
from policies.block_loop_io import BakedBlockLoops, BlockLoopSpec
from policies.loop_io import BakedLoops

COMPILE_TIMEOUT_S = 900  # default; LLADA_COMPILE_TIMEOUT_S overrides (data tiling compiles take several times longer)
COMPILE_COMMAND = "llada compile"


def iree_version() -> str:
    from importlib.metadata import version

    return version("iree-base-compiler")


def compile_timeout() -> float:
    """Seconds iree-compile may take: LLADA_COMPILE_TIMEOUT_S, else COMPILE_TIMEOUT_S."""
    text = os.environ.get("LLADA_COMPILE_TIMEOUT_S")
    if text is None:
        return COMPILE_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise LladaError(f"LLADA_COMPILE_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return seconds


# IREE 3.13 can deadlock loading a tuning spec: the thread parsing it holds a lock while MLIR verifies the
# spec on the shared thread pool, and while it waits it may run another executable's configuration pass,
# which waits for that same lock (2 compiles in 30 hung). So a tuned compile stops after the executable
# sources, configures the executables (where the spec applies, a fraction of a second) on one thread, and
# goes on with threads from there. The vmfb is byte for byte what one threaded compile gives.
TUNED_PHASES = ("executable-sources", "executable-configurations")


def compile_module(text: str, flags: tuple[str, ...], out: Path, timeout: float = COMPILE_TIMEOUT_S,
                   tuning: str | None = None) -> float:
    """Run iree-compile in its own process group, every phase within one `timeout` that kills the whole
    group; `tuning`: a tuning spec's text (`lowering.matmul_tiles`)."""
    source, spec = out.with_suffix(".mlir"), out.with_suffix(".tiles.mlir")
    phases = [out.with_suffix(f".{phase}.mlir") for phase in TUNED_PHASES]
    source.write_text(text)
    if tuning is not None:
        spec.write_text(tuning)
    started = time.perf_counter()
    try:
        commands = _compile_commands(source, flags, out, spec if tuning is not None else None, phases)
        for number, command in enumerate(commands, 1):
            phase = f" in phase {number} of {len(commands)}" if len(commands) > 1 else ""
            _run_compiler(command, timeout - (time.perf_counter() - started), timeout, phase)
    finally:
        for path in (source, spec, *phases):
            path.unlink(missing_ok=True)
    return time.perf_counter() - started


def _compile_commands(source: Path, flags, out: Path, spec: Path | None, phases: list[Path]) -> list[list[str]]:
    from iree.compiler.tools.binaries import find_tool

    tool = find_tool("iree-compile")
    if spec is None:
        return [[tool, str(source), "--iree-input-type=stablehlo", *flags, "-o", str(out)]]
    keep_locations = "--mlir-print-debuginfo"  # source locations carried across phases, as in one compile
    (sources, configured), (to_sources, to_configured) = phases, TUNED_PHASES
    return [
        [tool, str(source), "--iree-input-type=stablehlo", *flags, f"--compile-to={to_sources}", keep_locations,
         "-o", str(sources)],
        [tool, str(sources), *flags, f"--compile-from={to_sources}", f"--compile-to={to_configured}",
         f"--iree-codegen-tuning-spec-path={spec}", "--mlir-disable-threading", keep_locations, "-o", str(configured)],
        [tool, str(configured), *flags, f"--compile-from={to_configured}", "-o", str(out)],
    ]


def _run_compiler(command: list[str], seconds_left: float, timeout: float, phase: str = "") -> None:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(seconds_left, 0.001))
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise LladaError(f"iree-compile took longer than {timeout:g} s and was stopped (LLADA_COMPILE_TIMEOUT_S "
                         "sets the limit)") from None
    except BaseException:  # an interrupt: the compiler (a session of its own, out of the terminal's reach) goes too
        _stop(proc)
        raise
    if proc.returncode != 0:
        how = (f"was killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"failed (exit status {proc.returncode})")
        said = err.strip() or out.strip()  # its message, wherever it wrote one
        last = (said.splitlines() or ["no output"])[-1]
        first = next((line for line in said.splitlines() if "error" in line), last)
        raise LladaError(f"iree-compile {how}{phase}: {first}")


def _stop(proc: subprocess.Popen) -> None:
    """Kill the compiler's process group and reap it (not reaped before: the group id is still its own)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def compile_bundle(model_dir, target_name: str, out_dir, *, max_len: int = 256, window: int = 64,
                   dtype: str = "float32", copy_weights: bool = True, device_memory_budget: int | None = None,
                   loops: tuple[BakedLoops | BakedBlockLoops, ...] = (), batch_sizes: tuple[int, ...] = (1,),
                   activations: Activations = "float", data_tiling: bool = False, progress=None,
                   force: bool = False, kernels: Kernels = "own", block_length: int | None = None) -> Path:
    """Compile every step for canvases up to `max_len`, windows up to `window` and each of `batch_sizes` rows (a
    batch of prompts runs in steps of these sizes) into a bundle; `block_length`: on a block-diffusion model, only
    the steps its decoder takes with blocks of this length (other models: ignored; None: every shape). With a device
    memory budget smaller than the weights, the program streams its layers and LM head (and, if it must, the
    embedding: `lowering.stage_ring`).
    `loops`: decoding settings whose compiled decode loops go beside the steps, with a `run.sh` that runs the first
    one without Python. A quantized checkpoint's integers are bound as they are stored (`lowering.bundle_weights`);
    `activations="int8"` runs its int8 per-channel layers as W8A8 matmuls. `data_tiling`: IREE's data tiling on a
    CPU target with resident weights (faster steps; a re-laid copy of the weights is held beside them).
    `kernels="own"`: our kernels run the quantized matmuls on a CPU target with a C compiler for it
    (`lowering.kernel_dispatch`). It replaces only an earlier bundle, with `force` (`llada_jax.system.atomic`)."""
    tgt = target(target_name)
    model_dir, out_dir = Path(model_dir).absolute(), Path(out_dir).absolute()
    config = _checked_config(model_dir, max_len, window)
    block_length = checked_block_length(config, block_length, max_len)
    check_output_dir(out_dir, COMPILE_COMMAND, (model_dir,), force)  # before minutes of export and compile
    archive = copy_weights and tgt.driver == "local-task"  # a CPU device maps it in place
    compiler, layout = bundle_layout(tgt, model_dir, config, kernels, activations, archive, device_memory_budget)
    _check_loops(loops, config, layout, block_length)
    compute, batch_sizes = compute_dtype(dtype), check_batch_sizes(batch_sizes)
    specs = step_specs(max_len, window, batch_sizes, block_length)
    flags, timeout = compile_flags(tgt, data_tiling, layout.streamed, bool(loops)), compile_timeout()  # before export
    loop_specs = _loop_specs(loops, max_len, layout.streamed)
    say = progress or (lambda message: None)
    tiles = target_tiles(tgt, data_tiling)
    functions = _functions(specs, loop_specs, config, compute, layout, activations, tgt.layout_rule(data_tiling))
    say(f"exporting {len(specs)} steps{f' and {len(loop_specs)} decode loops' if loop_specs else ''} to StableHLO")
    with atomic_dir(out_dir, COMPILE_COMMAND, inputs=(model_dir,), force=force) as staging, \
            tempfile.TemporaryDirectory(prefix="llada-kernels-", dir=staging) as objects:  # scratch if killed
        module = bundle_module(functions, layout, config,
                               target_objects(tgt, compiler, Path(objects)) if compiler else None)
        tuned = tunable_matmuls(module, tiles)
        say(f"compiling for {tgt.name} ({tgt.note or tgt.driver})")
        spec = tuning_spec(tuned, tiles) if tuned and tiles else None
        seconds = compile_module(module, flags, staging / VMFB, timeout, spec)
        weights = _place_weights(model_dir, staging, copy_weights, layout, say)
        if loops:
            write_run_script(staging, loops[0], config, tgt.driver, weights)
        _copy_tokenizer(model_dir, staging)
        manifest = {
            "format": FORMAT_VERSION, "model_config": dict(config.to_hf_dict(), **_quantization(model_dir)),
            "eot_token_id": config.eot_token_id, "target": tgt.name, "driver": tgt.driver, "flags": list(flags),
            "iree_version": iree_version(), "tuned_matmuls": [list(s) for s in tuned], "compute_dtype": dtype,
            "matmul_tiles": tiles and tiles._asdict(), "activations": activations, "parameters": layout.manifest(),
            "kernels": kernels_manifest(tgt, compiler, layout), "max_len": max_len, "window": window,
            "block_length": block_length, "batch_sizes": list(batch_sizes), "compile_seconds": round(seconds, 2),
            "device_memory_budget": device_memory_budget, "streamed": _streamed(layout, config), "weights": weights,
            "steps": [signature_manifest(spec, config, compute) for spec in specs],
            "loops": [loop_manifest(spec, function) for spec, function in zip(loop_specs, functions[len(specs):])],
            "decoding": [baked.manifest() for baked in loops],
        }
        _write_manifest(staging, manifest)
    return out_dir


def _check_loops(loops, config, layout: WeightLayout, block_length: int | None) -> None:
    """Refuse, in one line, decode loops this bundle cannot carry."""
    if loops and loop_refusal(config, layout):
        raise LladaError(f"this {config.family} bundle carries steps only (compile with --no-loop): "
                         f"{loop_refusal(config, layout)}")
    for baked in loops:
        if isinstance(baked, BakedBlockLoops) and block_length not in (None, baked.settings.block_length):
            raise LladaError(f"the decode loop's blocks ({baked.settings.block_length}) are not the bundle's "
                             f"--block-length ({block_length})")


def _copy_tokenizer(model_dir: Path, staging: Path) -> None:
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, staging / name)


def _loop_specs(loops, max_len: int, streamed: bool) -> list:
    """The distinct decode loops of `loops` (thresholds are inputs, not shapes), each on a canvas of the bundle."""
    specs = list(dict.fromkeys(spec for baked in loops for spec in baked.specs))
    if any(spec.slots not in canvas_sizes(max_len) for spec in specs):
        raise LladaError(f"a decode loop's canvas is not one of this bundle's sizes {canvas_sizes(max_len)}")
    if streamed and not all(spec.caches for spec in specs):
        raise LladaError("IREE 3.13 fails to compile a vanilla decode loop that streams its weights ('failed to solve "
                         "for timepoint coverage'): use --policy prefix-cache or dual-cache, or --no-loop")
    return specs


def _functions(specs, loop_specs, config, compute, layout, activations: Activations, rule) -> list:
    """The functions to export: each step, then each decode loop, in the target's activation layouts."""
    def decode_loop(spec):
        if isinstance(spec, BlockLoopSpec):
            return block_loop_function(spec, config, compute, layout, activations, rule)
        return loop(spec, config, compute, layout, activations, rule)

    return [step(spec, config, compute, layout, activations, rule) for spec in specs] + list(map(decode_loop,
                                                                                                loop_specs))


def _write_manifest(staging: Path, manifest: dict) -> None:
    """The manifest, with the sha256 of every file written so far."""
    manifest["files"] = {p.name: sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def loop_refusal(config, layout: WeightLayout | None = None) -> str | None:
    """Why a bundle of this model (its weights laid out as `layout`, if known) cannot carry a compiled decode loop
    (None: it can)."""
    if host_loop_conventions(config):
        return ("the compiled decode loop follows LLaDA's conventions, and this family's own (its confidence "
                "filter, blocks begun with their first token) run on the host loop")
    routed = layout is not None and routed_experts(layout, config)
    resident = layout is not None and not layout.streamed
    if config.block_causal and not routed:
        return ("IREE 3.13 runs the block-diffusion loop only where the experts are stacked on our routed kernels "
                "(a 4- or 8-bit checkpoint in a CPU bundle: resident in its own archive, or streamed under a "
                "budget); elsewhere it fails ('indirect buffer reference slot 0 is out of range'); XLA runs it "
                "(--loop compiled)")
    if config.n_experts and not config.block_causal and not (routed and resident):
        return ("IREE 3.13 fails on a sparse MoE's decode loop unless its experts are stacked on our routed kernels "
                "and resident (it fails to compile, or the module crashes); a CPU bundle of a 4- or 8-bit checkpoint "
                "with its weights copied and no budget carries the loop")
    return None


def _checked_config(model_dir: Path, max_len: int, window: int):
    config = read_config(checked_model_dir(model_dir), eot_token_id=eot_id_from_files(model_dir))
    if not 0 < max_len <= config.max_sequence_length:
        raise LladaError(f"--max-len must be in [1, {config.max_sequence_length}], got {max_len}")
    if window <= 0:
        raise LladaError(f"--window must be positive, got {window}")
    return config


def checked_block_length(config, block_length: int | None, max_len: int) -> int | None:
    """The block length whose steps a bundle of this model holds (None: every shape; always on models that are
    not block diffusion), checked against the longest canvas."""
    if block_length is None or not config.block_causal:
        return None
    if not 0 < block_length <= max_len:
        raise LladaError(f"--block-length must be in [1, --max-len {max_len}], got {block_length}")
    return block_length


def check_batch_sizes(batch_sizes) -> tuple[int, ...]:
    """Distinct positive batch sizes, sorted; 1 always among them (a lone prompt, and a batch's rest)."""
    sizes = tuple(batch_sizes)
    if not sizes or any(not isinstance(size, int) or size < 1 for size in sizes):
        raise LladaError(f"batch sizes must be positive integers, got {list(sizes)}")
    return tuple(sorted(set(sizes) | {1}))


def _quantization(model_dir: Path) -> dict:
    """config.json's quantization_config, if any (the manifest's model config carries it)."""
    hf = read_hf_dict(model_dir)
    return {"quantization_config": hf["quantization_config"]} if "quantization_config" in hf else {}


def _streamed(layout: WeightLayout, config) -> dict | None:
    """What the manifest says of streamed weights: the ring's size and each stage's bytes."""
    if not layout.streamed:
        return None
    plan = ring_plan(layout, config)
    return {"ring_bytes": plan.ring_bytes, "resident_bytes": resident_bytes(layout, config),
            "embedding_streamed": layout.streams_embedding,
            "stage_bytes": [sum(piece.length for piece in stage) for stage in plan.stages]}


def _place_weights(model_dir: Path, staging: Path, copy: bool, layout: WeightLayout, say) -> dict:
    """Record absolute paths to the model's safetensors files, or copy them into the bundle: for a layout of
    signed integers (a CPU device reading resident named parameters) as one IREE parameter archive, whose
    aligned entries the device maps in place (safetensors entries are not aligned for that: the device copies
    every weight at load); else as they are (a GPU uploads them anyway; the host side path reads them)."""
    files = sorted(set(weight_files(model_dir).values()))
    if not copy:
        linked = [model_dir.absolute() / f for f in files]
        return {"files": [str(path) for path in linked], "copied": False, "stamps": [file_stamp(p) for p in linked]}
    say(f"copying {sum(map(byte_size, layout.parameters)) / 1e9:.2f} GB of weights into the bundle")
    if layout.signed:
        signed = {module: scheme for module, scheme in layout.quantized.items() if module not in layout.kernels}
        write_archive([model_dir / name for name in files], staging / ARCHIVE, signed, layout.stacks)
        return {"files": [ARCHIVE], "copied": True}
    for name in files + ([INDEX_FILE] if (model_dir / INDEX_FILE).is_file() else []):
        shutil.copyfile(model_dir / name, staging / name)
    return {"files": files, "copied": True}

