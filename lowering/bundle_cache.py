"""Bundles compiled on the fly for `--backend iree-*`, cached by what determines their content."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from llada_jax.kernels.build import HEADERS, KERNEL_SOURCES
from llada_jax.model.config import read_config
from llada_jax.quant.choice import Kernels
from llada_jax.quant.quantize import Activations
from llada_jax.system.atomic import write_once
from llada_jax.system.locations import user_cache_dir
from lowering.bundle import check_batch_sizes, checked_block_length, compile_bundle, iree_version, loop_refusal
from lowering.bundle_format import FORMAT_VERSION, MANIFEST, sha256
from lowering.matmul_tiles import host_tiles
from lowering.targets import TARGETS


def cached_bundle(model_dir, target: str, *, dtype: str = "float32", max_len: int | None = None,
                  window: int | None = None, device_memory_budget: int | None = None, loops: tuple = (),
                  batch_sizes: tuple[int, ...] = (1,), activations: Activations = "float", data_tiling: bool = False,
                  progress=None, kernels: Kernels = "own", block_length: int | None = None) -> Path:
    """A bundle for this model (by content), target, dtype, activations, kernels, data tiling, shapes (a
    block-diffusion model's: those of `block_length`), budget, compiled decode loops, IREE version and this host's
    matmul tiles, the target's kernel flags; compiled if absent."""
    model_dir = Path(model_dir).absolute()
    config = read_config(model_dir)
    loops = () if loop_refusal(config) else loops  # see `bundle.compile_bundle`
    max_len = max_len or config.max_sequence_length
    window = window or max_len
    block_length = checked_block_length(config, block_length, max_len)
    weights = sorted(p for p in model_dir.iterdir() if p.suffix == ".safetensors")
    kernel_build = TARGETS[target].kernels if target in TARGETS else None  # an unknown target is refused later
    key = json.dumps({"config": sha256(model_dir / "config.json"),
                      "weights": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights],
                      "target": target, "dtype": dtype, "activations": activations, "kernels": kernels,
                      "data_tiling": data_tiling,
                      "max_len": max_len, "window": window, "block_length": block_length,
                      "budget": device_memory_budget, "format": FORMAT_VERSION, "iree": iree_version(),
                      "loops": sorted({spec.name for baked in loops for spec in baked.specs}),
                      "batch_sizes": check_batch_sizes(batch_sizes),
                      "code": _exporting_code(), "host_tiles": host_tiles(),
                      "kernel_flags": kernel_build.flags if kernel_build else None},
                     sort_keys=True)
    out = user_cache_dir("bundles") / hashlib.sha256(key.encode()).hexdigest()[:20]
    return write_once(out, lambda out: (out / MANIFEST).is_file(), lambda: compile_bundle(
        model_dir, target, out, max_len=max_len, window=window, dtype=dtype, copy_weights=False,
        device_memory_budget=device_memory_budget, loops=loops, batch_sizes=batch_sizes, activations=activations,
        data_tiling=data_tiling, progress=progress, kernels=kernels, block_length=block_length))


# The source files that decide what a bundle computes: a change to any of them compiles a new bundle.
EXPORTING_CODE = tuple(f"llada_jax/{name}.py" for name in (
    "model/forward", "model/moe", "model/layout", "model/steps", "model/staged", "quant/qlinear", "model/params",
    "model/shapes", "model/kv_state", "model/readout"))
DECODING_CODE = tuple(f"policies/{name}.py" for name in (
    "decode_loop", "loop_io", "decisions", "cache_policies", "schedule"))
LOWERING_CODE = tuple(f"lowering/{name}.py" for name in (
    "export", "bundle", "bundle_weights", "targets", "matmul_tiles", "run_script", "kernel_dispatch", "bundle_module",
    "bundle_params", "stage_ring"))
KERNEL_CODE = tuple(f"llada_jax/kernels/{name}" for name in (
    "xla.py", "activations.py", "schemes.py", "build.py", *(f"c/{source}" for source in (
        *KERNEL_SOURCES, *HEADERS, "iree_dispatch.c")))) + ("llada_jax/quant/choice.py",)


def _exporting_code() -> str:
    root = Path(__file__).resolve().parent.parent
    files = [root / path for path in (*EXPORTING_CODE, *DECODING_CODE, *LOWERING_CODE, *KERNEL_CODE)]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()
