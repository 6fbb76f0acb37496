"""LLaDA in pure-functional JAX: explicit KV state, fixed-shape steps, verifiable decoders.

Attributes load lazily, so jax-free parts (config, tokenizer, decoding, the IREE runtime) can be
imported without importing JAX.
"""

import importlib

_EXPORTS = {
    "Model": "llada_jax.loading",
    "generate": "llada_jax.api",
    "load": "llada_jax.loading",
    "logits": "llada_jax.api",
    "LLaDAConfig": "llada_jax.config",
    "LladaError": "llada_jax.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llada_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
