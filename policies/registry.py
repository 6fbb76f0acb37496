"""Policy specs as the CLI and `generate(policy=...)` accept them.

    BASE[+speculative[:LOOKAHEAD[:DRAFT_THRESHOLD]]][+revision[:REVISE_THRESHOLD[:CONFIRMATIONS]]]

BASE is vanilla, prefix-cache or dual-cache; e.g. `dual-cache+speculative:1:0.9+revision`.
"""

from __future__ import annotations

from llada_jax.errors import LladaError
from policies.cache_policies import CACHE_POLICIES
from policies.policy import Policy
from policies.revision import Revision
from policies.speculative import Speculative

MODIFIERS = ("speculative", "revision")


def _numbers(spec: str, args: list[str], kinds: tuple) -> list:
    if len(args) > len(kinds):
        raise LladaError(f"policy part {spec!r} takes at most {len(kinds)} parameters")
    try:
        return [kind(arg) for kind, arg in zip(kinds, args)]
    except ValueError:
        raise LladaError(f"bad number in policy part {spec!r}") from None


def make_policy(spec: str) -> Policy:
    base_name, *modifiers = spec.split("+")
    if base_name not in CACHE_POLICIES:
        raise LladaError(f"unknown policy {base_name!r}; choose one of {', '.join(CACHE_POLICIES)} "
                         f"(optionally +{' +'.join(MODIFIERS)})")
    policy = CACHE_POLICIES[base_name]()
    for modifier in modifiers:
        name, *args = modifier.split(":")
        if name == "speculative":
            policy = Speculative(policy, *_numbers(modifier, args, (int, float)))
        elif name == "revision":
            policy = Revision(policy, *_numbers(modifier, args, (float, int)))
        else:
            raise LladaError(f"unknown policy modifier {name!r}; choose from {', '.join(MODIFIERS)}")
    return policy
