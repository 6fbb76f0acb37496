"""`llada convert`: a checkpoint re-laid by llada-jax's safetensors writer, tensor for tensor and byte for
byte, every tensor it can on a 64-byte boundary, so that a CPU device uses its weights in place
(`SafetensorsFile.mapped`). The HF writer aligns its header to 8 bytes only: its shards' tensors usually
sit off the boundary and are copied at every load."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from llada_jax.model.config import read_config
from llada_jax.system.atomic import MARKER, atomic_dir
from llada_jax.weights.safetensors_file import DTYPES, SafetensorsFile, write_tensors
from llada_jax.weights.stored_layout import Layout, check_stored, stored_layout
from llada_jax.weights.weights_io import check_names, checkpoint_quantization, weight_files

CONVERT_COMMAND = "llada convert"


def realign_checkpoint(model_dir: Path, out_dir: Path, force: bool = False, progress: bool = False) -> Path:
    """Write `model_dir` re-laid to `out_dir` (never over the input or the user's files; over an earlier
    `llada convert` output only with `force`): the same files, the weights' shards rewritten one tensor at a
    time. `progress`: a bar on stderr, one step per shard."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = read_config(model_dir)
    weight_map = weight_files(model_dir)
    quantized = checkpoint_quantization(model_dir, config)
    check_names(weight_map, config, model_dir, quantized)
    shards = sorted(set(weight_map.values()))
    check_headers(model_dir, shards, stored_layout(config, quantized))  # what would not load is not written
    with atomic_dir(out_dir, CONVERT_COMMAND, inputs=(model_dir,), force=force) as staging:
        for path in model_dir.iterdir():
            if path.is_file() and path.name not in shards and path.name != MARKER:
                shutil.copyfile(path, staging / path.name)
        for shard in tqdm(shards, desc="convert", unit="shard", disable=not progress, file=sys.stderr):
            with SafetensorsFile(model_dir / shard) as stored:
                specs = {name: (DTYPES[dtype], shape) for name, (dtype, shape, _, _) in stored.entries.items()}
                write_tensors(staging / shard, specs, stored.read, stored.metadata)
    return out_dir


def check_headers(model_dir: Path, shards: list[str], layout: Layout) -> None:
    """Each tensor of the shards' headers of the dtype kind and shape config.json implies (nothing read but
    the headers)."""
    for shard in shards:
        with SafetensorsFile(model_dir / shard) as stored:
            for name, (dtype, shape, _, _) in stored.entries.items():
                if name in layout:
                    check_stored(name, DTYPES[dtype], shape, layout[name], model_dir / shard)
