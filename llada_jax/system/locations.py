"""Where things live: the embedded default model inside the package, and the user's cache directory."""

from __future__ import annotations

import os
from pathlib import Path

from llada_jax.system.errors import LladaError

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-llada"


def default_model_dir() -> Path:
    if not (EMBEDDED_DIR / "config.json").is_file():
        raise LladaError(f"no embedded model at {EMBEDDED_DIR}; pass --model DIR")
    return EMBEDDED_DIR


def user_cache_dir(kind: str) -> Path:
    """`$LLADA_CACHE/kind`, else `$XDG_CACHE_HOME/llada-jax/kind` (default ~/.cache): compiled bundles,
    XLA's persistent compilation cache, downloaded tools. Created on first use."""
    caches = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("LLADA_CACHE") or caches / "llada-jax") / kind
