"""Write a checkpoint with a real model's exact config, tensor names, shapes and bf16 storage (from
`eval/data/<model>`: LLaDA-8B-Instruct with its shard layout, Dream-v0-Instruct-7B, LLaDA-MoE-7B-A1B-Instruct,
LLaDA2.0-mini (inclusionAI's `llada2_mini` config from its dFactory repository, c29d72c)),
filled with random values: the real workload's size without its weights, which cannot be fetched here. About
15-16 GB; one shard is held at a time.

    python -m eval.scale_checkpoint --out /tmp/llada-8b-random [--model llada-8b] [--seed 0] [--layers N]

Values: N(0, 0.02) matrices drawn as rolls of one random pool (drawing 8e9 fresh normals costs minutes
and changes nothing a benchmark measures), unit norm gains. The write is atomic: the directory
appears complete or not at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from llada_jax.model.config import read_config
from llada_jax.model.params import hf_shapes
from llada_jax.system.atomic import atomic_dir
from llada_jax.system.errors import LladaError
from llada_jax.system.interrupts import run_interruptible
from llada_jax.weights.weights_io import INDEX_FILE

DATA = Path(__file__).resolve().parent / "data"
MODELS = {"llada-8b": DATA / "llada-8b-instruct", "dream-7b": DATA / "dream-v0-instruct-7b",
          "llada-moe-7b": DATA / "llada-moe-7b-a1b-instruct", "llada2-mini": DATA / "llada2-mini"}
METADATA_DIR = MODELS["llada-8b"]
SHARD_BYTES = 4 << 30  # where the metadata has no shard index of its own
# Odd, so prime to every row width (4096, 12288): row r of a matrix starts at offset r * width of the tiled
# pool, distinct for every row. With 2**24 the LM head's rows repeated every 4096, so each logit tied with 30
# others and argmax comparisons (eval.quant_agreement) were meaningless.
POOL_SIZE = (1 << 24) + 1
SCALE_COMMAND = "python -m eval.scale_checkpoint"


def random_tensor(shape: tuple[int, ...], pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if len(shape) == 1:
        return np.ones(shape, ml_dtypes.bfloat16)
    size = int(np.prod(shape))
    reps = -(-size // pool.size)
    start = int(rng.integers(pool.size))
    # A copy of just `size` values: a slice of the tiled pool would keep the whole pool alive per tensor (an
    # MoE checkpoint's thousands of small expert matrices each held the 32 MB pool).
    return np.tile(np.roll(pool, start), reps)[:size].reshape(shape).copy()


def write_scale_checkpoint(out_dir: Path, seed: int = 0, metadata_dir: Path = METADATA_DIR,
                           layers: int | None = None, force: bool = False) -> Path:
    """The checkpoint; with `layers`, only the first `layers` decoder layers, in one shard (every tensor
    keeps its real shape: a real-vocabulary, real-width test model of any size)."""
    config = read_config(metadata_dir)
    weight_map = (json.loads((metadata_dir / INDEX_FILE).read_text())["weight_map"]
                  if (metadata_dir / INDEX_FILE).is_file() else None)
    if weight_map is None or layers is not None:
        config = dataclasses.replace(config, n_layers=layers or config.n_layers)
        weight_map = size_sharded(hf_shapes(config), SHARD_BYTES if layers is None else None)
    shapes = hf_shapes(config)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL_SIZE, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    with atomic_dir(out_dir, SCALE_COMMAND, inputs=(metadata_dir,), force=force) as staging:
        for path in metadata_dir.iterdir():
            shutil.copyfile(path, staging / path.name)
        if layers is not None or not (metadata_dir / INDEX_FILE).is_file():
            _rewrite_layers(staging, shapes, weight_map, config.n_layers)
        shards = sorted(set(weight_map.values()))
        for number, shard in enumerate(shards, start=1):
            started = time.perf_counter()
            names = [name for name, file in weight_map.items() if file == shard]
            save_file({name: random_tensor(shapes[name], pool, rng) for name in names}, str(staging / shard),
                      metadata={"format": "pt"})
            print(f"[{number}/{len(shards)}] {shard}: {len(names)} tensors in {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
    return out_dir


def size_sharded(shapes: dict[str, tuple[int, ...]], shard_bytes: int | None) -> dict[str, str]:
    """Tensor name -> shard file, in order, a new shard past `shard_bytes` of bf16 (None: one shard)."""
    shards, size = [[]], 0
    for name, shape in shapes.items():
        if shard_bytes is not None and shards[-1] and size + 2 * int(np.prod(shape)) > shard_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append(name)
        size += 2 * int(np.prod(shape))
    return {name: f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            for number, names in enumerate(shards, start=1) for name in names}


def _rewrite_layers(staging: Path, shapes: dict[str, tuple[int, ...]], weight_map: dict[str, str], layers: int):
    """config.json's layer count and the shard index of the checkpoint written."""
    config = json.loads((staging / "config.json").read_text())
    key = "n_layers" if "n_layers" in config else "num_hidden_layers"
    if key == "num_hidden_layers" and "moe_layer_freq" in config:
        config["moe_layer_freq"] = config["moe_layer_freq"][:layers]
    (staging / "config.json").write_text(json.dumps({**config, key: layers}, indent=2))
    total = sum(2 * int(np.prod(shape)) for shape in shapes.values())  # bf16
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="new directory to write (atomically)")
    parser.add_argument("--force", action="store_true", help="replace an earlier output of this command in --out")
    parser.add_argument("--model", choices=sorted(MODELS), default="llada-8b", help="whose shapes and names")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="only the first N decoder layers, one shard")
    args = parser.parse_args(argv)
    most = read_config(MODELS[args.model]).n_layers
    if args.layers is not None and not 1 <= args.layers <= most:
        parser.error(f"--layers must be between 1 and {most}, got {args.layers}")
    try:
        status = run_interruptible("scale_checkpoint", lambda: write_scale_checkpoint(
            args.out, args.seed, MODELS[args.model], layers=args.layers, force=args.force))
    except LladaError as err:
        print(f"scale_checkpoint: error: {err}", file=sys.stderr)
        return 1
    if status == 0:
        print(args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
