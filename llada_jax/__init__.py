"""LLaDA in pure-functional JAX: explicit KV state, fixed-shape steps, verifiable decoders."""

from llada_jax.api import Model, generate, load, logits
from llada_jax.config import LLaDAConfig
from llada_jax.errors import LladaError

__all__ = ["LLaDAConfig", "LladaError", "Model", "generate", "load", "logits"]
