"""`llada quantize`: an HF LLaDA checkpoint rewritten with integer weights (no JAX), streaming.

Decoder-layer matrices get the chosen scheme (int8 per output channel, or int4 with group-wise
scales); the embedding gets int8 per row (`quant_config.EDGE_SCHEME`), and so does the LM head unless
`head` says otherwise; norm gains
keep their stored dtype. Output: compressed-tensors "pack-quantized" safetensors, sharded, with its
`quantization_config` in config.json, so transformers/vLLM-style loaders read the same files.
Tensors are read, quantized and written one at a time (at most one shard, `shard_bytes`, is held);
the directory appears atomically, complete or not at all.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from llada_jax.model.config import read_config, read_hf_dict
from llada_jax.model.params import hf_shapes
from llada_jax.quant.quantize import QuantScheme, pack_int32, quantize_matrix
from llada_jax.system.atomic import atomic_dir
from llada_jax.system.errors import LladaError
from llada_jax.weights.quant_config import EDGE_SCHEME, planned_modules, quantization_config
from llada_jax.weights.safetensors_file import write_safetensors
from llada_jax.weights.weights_io import INDEX_FILE, checkpoint_quantization, iter_tensors

QUANTIZE_COMMAND = "llada quantize"
SHARD_BYTES = 2_000_000_000
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def stored_tensors(name: str, array, scheme: QuantScheme | None) -> dict[str, np.ndarray]:
    """What the checkpoint stores for one `.weight` tensor: itself, or its packed integers and scales."""
    if scheme is None:
        return {name: array}
    q, scale = quantize_matrix(np.asarray(array, np.float32), scheme, f"tensor {name}")
    module = name[: -len(".weight")]
    return {f"{module}.weight_packed": pack_int32(q, scheme.bits),
            f"{module}.weight_scale": scale.astype(ml_dtypes.bfloat16),
            f"{module}.weight_shape": np.asarray(q.shape, np.int64)}


class ShardWriter:
    """Writes tensors into shards of about `shard_bytes`, then names them `model-i-of-n` with an index."""

    def __init__(self, out_dir: Path, shard_bytes: int):
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.files: list[list[str]] = []
        self.total = 0

    def add(self, tensors: dict[str, np.ndarray]) -> None:
        size = sum(a.nbytes for a in tensors.values())
        if self.pending and sum(a.nbytes for a in self.pending.values()) + size > self.shard_bytes:
            self.flush()
        self.pending.update(tensors)
        self.total += size

    def flush(self) -> None:
        if self.pending:
            write_safetensors(self.out_dir / f"shard-{len(self.files)}.tmp", self.pending, {"format": "pt"})
            self.files.append(list(self.pending))
            self.pending = {}

    def finish(self) -> None:
        self.flush()
        weight_map = {}
        for number, names in enumerate(self.files, start=1):
            file = f"model-{number:05d}-of-{len(self.files):05d}.safetensors"
            (self.out_dir / f"shard-{number - 1}.tmp").rename(self.out_dir / file)
            weight_map.update({name: file for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def quantize_checkpoint(model_dir: Path, out_dir: Path, scheme: QuantScheme, shard_bytes: int = SHARD_BYTES,
                        progress: bool = False, head: QuantScheme = EDGE_SCHEME, force: bool = False) -> Path:
    """Write the quantized copy of `model_dir` to `out_dir` (never over the input or the user's files; over
    an earlier quantized copy only with `force`); `progress`: a bar on stderr, one step per tensor."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = read_config(model_dir)
    if checkpoint_quantization(model_dir, config):
        raise LladaError(f"{model_dir} is already quantized: quantize the original checkpoint")
    for name in ("d_model", "mlp_hidden_size"):
        scheme.groups(getattr(config, name))
    head.groups(config.d_model)
    schemes = planned_modules(config, scheme, head)
    with atomic_dir(out_dir, QUANTIZE_COMMAND, inputs=(model_dir,), force=force) as staging:
        _copy_metadata(model_dir, staging, quantization_config(config, scheme, head))
        writer = ShardWriter(staging, shard_bytes)
        tensors = tqdm(iter_tensors(model_dir, config), total=len(hf_shapes(config)), desc="quantize", unit="tensor",
                       disable=not progress, file=sys.stderr)
        for name, array in tensors:
            writer.add(stored_tensors(name, array, schemes.get(name[: -len(".weight")])))
        writer.finish()
    return out_dir


def _copy_metadata(model_dir: Path, out_dir: Path, quantization: dict) -> None:
    """Every non-weight file (tokenizer, generation config), and config.json with its quantization."""
    for path in model_dir.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(path, out_dir / path.name)
    hf_config = dict(read_hf_dict(model_dir), quantization_config=quantization)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
