"""LLaDA in pure-functional JAX: explicit KV state, fixed-shape steps, verifiable decoders.

Attributes load lazily, so jax-free parts (config, tokenizer, decoding, the IREE runtime) can be
imported without importing JAX.
"""

import importlib
import os

# XLA's CPU scheduler that favours concurrency starts every weight's dequantization at the top of a step
# and keeps all of them live: a group-wise int4 LLaDA-8B step asked for 30 GB for a 4.7 GB model. The
# default scheduler makes one matrix's float copy at a time. It must be set before JAX starts its CPU
# backend; a value for this flag already in XLA_FLAGS wins.
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
if _SCHEDULER_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_SCHEDULER_FLAG}=false".strip()

_EXPORTS = {
    "Model": "llada_jax.weights.loading",
    "generate": "llada_jax.api",
    "load": "llada_jax.weights.loading",
    "logits": "llada_jax.api",
    "LLaDAConfig": "llada_jax.model.config",
    "LladaError": "llada_jax.system.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llada_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
