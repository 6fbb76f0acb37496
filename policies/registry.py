"""Policy names as the CLI and `generate(policy=...)` accept them."""

from __future__ import annotations

from llada_jax.errors import LladaError
from policies.cache import CACHE_POLICIES


def make_cache_policy(name: str):
    if name not in CACHE_POLICIES:
        raise LladaError(f"unknown policy {name!r}; choose one of {', '.join(CACHE_POLICIES)}")
    return CACHE_POLICIES[name]()
