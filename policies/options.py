"""Every setting of one generation, as one frozen record: the keywords `llada_jax.generate` takes."""

from __future__ import annotations

import dataclasses

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
    policy: str = "vanilla"                  # POLICY grammar of `policies.registry`
    threshold: float | None = None           # Fast-dLLM's threshold rule (None: the fixed schedule)
    seed: int = 0
    logits_eos_inf: bool = False             # forbid EOS in the answer
    confidence_eos_eot_inf: bool = False     # never commit EOS/EoT early
    limit: int | None = None                 # a compiled bundle's longest canvas, when below the model's own
    schedule: str = "llada"                  # `llada` or `dream[:EPS]`
    top_k: int | None = None                 # Dream's confidence filters (None: the family's default)
    top_p: float | None = None
    first_token: bool | None = None          # a cached block's first step commits its first position alone

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
