"""A model directory's fingerprint: which model a result was computed with, cheap enough to take at every
load. It reads the config and tokenizer files and the weight files' sizes and sampled bytes, never a path, so a
copied or moved checkpoint keeps its fingerprint, and another checkpoint of the same shapes (trained or
fine-tuned otherwise) gets another."""

from __future__ import annotations

import hashlib
from pathlib import Path

from llada_jax.weights.weights_io import weight_files

WHOLE_FILE_BYTES = 16 << 20  # files up to this size are hashed whole
SAMPLES = 256                # a larger file: this many evenly spaced blocks, its first and last bytes among them
SAMPLE_BYTES = 64 << 10
SETTING_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def fingerprint(model_dir: Path) -> str:
    """Hex digest of the SETTING_FILES there and every weight file's name, size and (sampled) bytes."""
    digest = hashlib.sha256()
    for name in SETTING_FILES:
        if (model_dir / name).is_file():
            digest.update(f"\0{name}\0".encode() + (model_dir / name).read_bytes())
    for name in sorted(set(weight_files(model_dir).values())):
        size = (model_dir / name).stat().st_size
        digest.update(f"\0{name}\0{size}\0".encode())
        length = size if size <= WHOLE_FILE_BYTES else SAMPLE_BYTES
        with open(model_dir / name, "rb") as handle:
            for offset in sample_offsets(size):
                handle.seek(offset)
                digest.update(handle.read(length))
    return digest.hexdigest()


def sample_offsets(size: int) -> list[int]:
    """Where the sampled blocks start: 0 alone for a file hashed whole."""
    if size <= WHOLE_FILE_BYTES:
        return [0]
    last = size - SAMPLE_BYTES
    return [last * k // (SAMPLES - 1) for k in range(SAMPLES)]
