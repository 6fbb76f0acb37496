"""Model families, each a small declared thing: its config reader and writer and its tensor-name map (the
forward's deltas are `LLaDAConfig` flags the shared forward reads). A checkpoint's family is chosen by its
config.json's `architectures[0]`, never guessed from shapes. No JAX here: the bundle runtime reads configs."""

from __future__ import annotations

from llada_jax.families import dream, llada, llada2, llada_moe
from llada_jax.system.errors import LladaError

FAMILIES = (llada, dream, llada_moe, llada2)
BY_ARCHITECTURE = {family.ARCHITECTURE: family for family in FAMILIES}
BY_NAME = {family.NAME: family for family in FAMILIES}
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)


def from_architectures(architectures):
    """The family config.json's `architectures` names; a config without the field is read as LLaDA."""
    if architectures is None:
        return llada
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise LladaError(f"config.json field architectures must be a list of names, got {architectures!r}")
    if architectures[0] not in BY_ARCHITECTURE:
        raise LladaError(f"config.json names architecture {architectures[0]!r}, which llada-jax does not load "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return BY_ARCHITECTURE[architectures[0]]


def named(name: str):
    return BY_NAME[name]


def host_loop_conventions(config) -> bool:
    """Whether the family's own decoding conventions (a confidence filter, blocks begun with their first token)
    need the host loop: the compiled decode loop follows LLaDA's."""
    family = named(config.family)
    return family.CONFIDENCE_TOP_K is not None or family.FIRST_TOKEN_BLOCKS

