"""The decoder grammar, the one place it is parsed: what `--policy`, eval, bench and
`generate(policy=..., threshold=...)` accept.

    SETTING = POLICY[@THRESHOLD]
    POLICY  = BASE[+speculative[:LOOKAHEAD[:DRAFT_THRESHOLD]]][+revision[:REVISE_THRESHOLD[:CONFIRMATIONS]]]

BASE is vanilla, prefix-cache or dual-cache; THRESHOLD switches the commit rule from LLaDA's fixed
schedule to Fast-dLLM's threshold rule; e.g. `dual-cache+speculative:1:0.9+revision@0.9`.
"""

from __future__ import annotations

import dataclasses

from llada_jax.system.errors import LladaError
from policies.cache_policies import CACHE_POLICIES
from policies.policy import Policy
from policies.revision import Revision
from policies.schedule import ThresholdRule
from policies.speculative import Speculative

# Each modifier: the policy it wraps around another, and the types and defaults of its parameters.
MODIFIERS = {
    "speculative": (Speculative, (int, float), (Speculative.lookahead, Speculative.draft_threshold)),
    "revision": (Revision, (float, int), (Revision.revise_threshold, Revision.confirmations)),
}


@dataclasses.dataclass(frozen=True)
class DecoderSetting:
    """A decoder as users write it: POLICY[@THRESHOLD]."""

    policy: str
    threshold: float | None = None

    def __post_init__(self):
        """Checked whole when written, so a bad setting stops a run before any model loads or step runs."""
        make_policy(self.policy)
        if self.threshold is not None:
            ThresholdRule(self.threshold)

    @classmethod
    def parse(cls, text: str) -> DecoderSetting:
        policy, at, threshold = text.partition("@")
        try:
            return cls(policy, float(threshold) if at else None)
        except ValueError:
            raise LladaError(f"bad threshold in --policy {text!r}; use POLICY or POLICY@THRESHOLD, "
                             "e.g. dual-cache@0.9") from None

    def __str__(self) -> str:
        return self.policy if self.threshold is None else f"{self.policy}@{self.threshold}"


def parse_policy(spec: str) -> tuple[str, dict[str, list[str]]]:
    """(BASE, {modifier: its parameters as written}), names checked."""
    if "@" in spec:  # the command line's POLICY@THRESHOLD; here the threshold is an option of its own
        policy, _, threshold = spec.partition("@")
        raise LladaError(f"a policy names no threshold: give policy={policy!r}, threshold={threshold} "
                         "(POLICY@THRESHOLD is the command line's --policy form)")
    base, *parts = spec.split("+")
    if base not in CACHE_POLICIES:
        raise LladaError(f"unknown policy {base!r}; choose one of {', '.join(CACHE_POLICIES)} "
                         f"(optionally +{' +'.join(MODIFIERS)})")
    modifiers = {}
    for part in parts:
        name, *args = part.split(":")
        if name not in MODIFIERS:
            raise LladaError(f"unknown policy modifier {name!r}; choose from {', '.join(MODIFIERS)}")
        if name in modifiers:
            raise LladaError(f"policy modifier {name!r} given twice in {spec!r}")
        modifiers[name] = args
    return base, modifiers


def make_policy(spec: str) -> Policy:
    """The policy a POLICY spec names, modifiers wrapped in the order written."""
    base, modifiers = parse_policy(spec)
    policy = CACHE_POLICIES[base]()
    for name, args in modifiers.items():
        wrapper, kinds, _ = MODIFIERS[name]
        policy = wrapper(policy, *_numbers(f"{name}:{':'.join(args)}" if args else name, args, kinds))
    return policy


def with_modifier(spec: str, name: str, values: tuple) -> str:
    """`spec` with modifier `name` given `values` (None: keep the spec's value, else the default)."""
    base, modifiers = parse_policy(spec)
    given, defaults = modifiers.get(name, []), MODIFIERS[name][2]
    modifiers[name] = [str(value if value is not None else (given[i] if i < len(given) else defaults[i]))
                       for i, value in enumerate(values)]
    return "+".join([base] + [":".join([modifier, *args]) for modifier, args in modifiers.items()])


def _numbers(part: str, args: list[str], kinds: tuple) -> list:
    if len(args) > len(kinds):
        raise LladaError(f"policy part {part!r} takes at most {len(kinds)} parameters")
    try:
        return [kind(arg) for kind, arg in zip(kinds, args)]
    except ValueError:
        raise LladaError(f"bad number in policy part {part!r}") from None
