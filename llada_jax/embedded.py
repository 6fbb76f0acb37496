"""Where the embedded default model lives inside the package."""

from __future__ import annotations

from pathlib import Path

from llada_jax.errors import LladaError

EMBEDDED_DIR = Path(__file__).parent / "assets" / "tiny-llada"


def default_model_dir() -> Path:
    if not (EMBEDDED_DIR / "config.json").is_file():
        raise LladaError(f"no embedded model at {EMBEDDED_DIR}; pass --model DIR")
    return EMBEDDED_DIR
