"""Every setting of one generation, as one frozen record: the keywords `llada_jax.generate` takes."""

from __future__ import annotations

import dataclasses
import math
import types
import typing

import numpy as np

from llada_jax.system.errors import LladaError
from policies.sampling import Remasking


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationOptions:
    """What to generate and how; `policies.generation.prepare_generation` validates it against the model."""

    gen_length: int
    block_length: int
    steps: int
    temperature: float = 0.0
    cfg_scale: float = 0.0
    remasking: Remasking = "low_confidence"
    policy: str | None = None                # POLICY grammar of `policies.registry`; None: the family's default
                                             # (vanilla, LLaDA's reference; block diffusion: its exact cache)
    threshold: float | None = None           # Fast-dLLM's threshold rule (None: the fixed schedule)
    seed: int = 0
    logits_eos_inf: bool = False             # forbid EOS in the answer
    confidence_eos_eot_inf: bool = False     # never commit EOS/EoT early
    limit: int | None = None                 # a compiled bundle's longest canvas, when below the model's own
    schedule: str = "llada"                  # `llada` or `dream[:EPS]`
    top_k: int | None = None                 # Dream's confidence filters (None: the family's default)
    top_p: float | None = None
    first_token: bool | None = None          # a cached block's first step commits its first position alone
    # Block diffusion (LLaDA2; `policies.block_diffusion`): steps are per block there.
    minimal_topk: int = 1                    # steps per block at most gen_length // minimal_topk
    editing_threshold: float | None = None   # set: LLaDA2.1's decoder, which edits committed tokens above it
    max_post_steps: int = 16                 # 2.1: editing passes after a block has no mask left
    num_to_transfer: int = 1                 # 2.1: masks committed per pass when too few are above threshold

    def __post_init__(self):
        """Each value of its field's declared type, refused in one line before anything runs (a float
        gen_length would be truncated silently, a string would fail deep inside)."""
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value, allowed = getattr(self, field.name), _alternatives(hints[field.name])
            if isinstance(value, np.generic):  # a numpy scalar is its Python value from here on
                value = value.item()
                object.__setattr__(self, field.name, value)
            if not any(_is_a(value, kind) for kind in allowed):
                names = " or ".join(_name(kind) for kind in allowed)
                raise LladaError(f"generation option {field.name} must be {names}, got {value!r}")
            if isinstance(value, (float, np.floating)) and not math.isfinite(value):  # inf sampling: noise
                raise LladaError(f"generation option {field.name} must be a finite number, got {value}")
        if self.seed < 0:
            raise LladaError(f"generation option seed must be >= 0, got {self.seed}")
        if self.limit is not None and self.limit <= 0:
            raise LladaError(f"generation option limit must be a positive length, got {self.limit}")
        if self.policy == "":
            raise LladaError("generation option policy must name a decoder (None: the family's default)")
        if self.cfg_scale > MAX_CFG_SCALE:  # the guided logits overflow long before, and no model uses such a scale
            raise LladaError(f"generation option cfg_scale must be at most {MAX_CFG_SCALE}, got {self.cfg_scale}")

    @classmethod
    def of(cls, options: dict) -> "GenerationOptions":
        """From keywords, refusing unknown or missing ones in one line."""
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise LladaError(f"unknown generation option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                             f"the options are {', '.join(names)}")
        missing = [field.name for field in dataclasses.fields(cls)
                   if field.default is dataclasses.MISSING and field.name not in options]
        if missing:
            raise LladaError(f"generation needs {', '.join(missing)}")
        return cls(**options)


MAX_CFG_SCALE = 100.0
BLOCK_OPTIONS = ("minimal_topk", "editing_threshold", "max_post_steps", "num_to_transfer")


def _alternatives(hint) -> tuple:
    """The types a field admits: each member of a union (`int | None`), else the type itself."""
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _is_a(value, kind) -> bool:
    if kind is type(None):
        return value is None
    if typing.get_origin(kind) is typing.Literal:
        return value in typing.get_args(kind)
    if isinstance(value, (bool, np.bool_)):  # True is an int to Python, not a length
        return kind is bool
    if kind is int:
        return isinstance(value, (int, np.integer))
    if kind is float:
        return isinstance(value, (int, float, np.integer, np.floating))
    return isinstance(value, kind)


def _name(kind) -> str:
    if typing.get_origin(kind) is typing.Literal:
        return "one of " + ", ".join(typing.get_args(kind))
    return {type(None): "None", int: "an integer", float: "a number", bool: "true or false", str: "text"}[kind]
