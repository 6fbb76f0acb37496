"""The compiled decode loop's static structure, inputs and outputs: plain data shared by the JAX loop
(`policies.decode_loop`), the exporter and the bundle runtime. No JAX here.

Its trace is compact: per generated position the forward pass that committed it and that pass's log-
probability; per forward pass its block, padded and real width and useful positions. With no revision
(a committed token never changes in the compiled loop) that is everything a host-loop `StepRecord` holds.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from llada_jax.model.arrays import Array
from llada_jax.model.readout import read_width
from llada_jax.model.shapes import bucket
from policies.cache_policies import Cached, CachePolicy
from policies.decisions import speculative_width
from policies.schedule import Schedule

NOT_COMMITTED = -1


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """The static structure of one compiled loop: a canvas of `slots` positions (prompt + gen_length
    fit in it), the cache policy, speculation's lookahead and window, and the commit rule's kind. Hashable: a
    static argument of the jitted loop."""

    policy: CachePolicy   # vanilla, prefix-cache or dual-cache (speculation: the policy it drafts over)
    threshold_rule: bool  # Fast-dLLM's threshold rule (else LLaDA's fixed schedule)
    lookahead: int        # speculation: following blocks drafted (0: none)
    spec_width: int       # speculation over dual-cache: window slots asked for (0: twice the block)
    schedule: Schedule    # gen_length, block_length, steps
    slots: int

    @property
    def stops_when_filled(self) -> bool:
        return self.policy.stops_when_filled or self.lookahead > 0

    @property
    def caches(self) -> bool:
        """The policy keeps K/V (prefix-cache, dual-cache); vanilla recomputes the whole canvas every pass."""
        return isinstance(self.policy, Cached)

    @property
    def max_passes(self) -> int:
        """Forward passes at most: a block takes its fixed steps, or one commit at least per pass."""
        return self.schedule.num_blocks * max(self.schedule.steps_per_block, self.schedule.block_length)

    def window_widths(self) -> tuple[int, ...]:
        """Slots of each block's window step: from the block start to the policy's window end, and with
        speculation over a block-only window the block and its drafts."""
        schedule, policy = self.schedule, self.policy
        if not isinstance(policy, Cached):  # vanilla runs no window
            return ()
        if self.lookahead and not policy.window_to_end:
            return (speculative_width(schedule.block_length, self.spec_width, self.slots),) * schedule.num_blocks
        starts = range(0, schedule.gen_length, schedule.block_length)
        ends = (policy.window_end(start + schedule.block_length, schedule.gen_length) for start in starts)
        return tuple(bucket(end - start, self.slots) for start, end in zip(starts, ends))

    def head_widths(self, rows: int) -> tuple[int, ...]:
        """The declared widths the LM head of a `rows`-row pass runs in: those covering 1 to block_length
        of the block's masks (the rows whose predictions the rule uses)."""
        return tuple(sorted({read_width(count, rows) for count in range(1, min(rows, self.schedule.block_length) + 1)}))

    def head_rows(self, width: int, useful: int) -> int:
        """The rows the LM head of a `width`-slot pass with `useful` masks to predict ran on: every row when
        drafts are read out, else the declared width covering them (at least one row). The host loop's plans
        read out the same (`policies.policy.StepPlan.read_columns`)."""
        return width if self.lookahead else read_width(max(useful, 1), width)

    @property
    def name(self) -> str:
        """The compiled function's name: the setting and shape in a symbol-safe form."""
        rule = "thr" if self.threshold_rule else "fixed"
        spec = f"_la{self.lookahead}w{self.spec_width}" if self.lookahead else ""
        schedule = self.schedule
        return (f"loop_{self.policy.name.replace('-', '')}{spec}_{rule}_g{schedule.gen_length}_b{schedule.block_length}"
                f"_n{schedule.steps}_s{self.slots}")

    def manifest(self) -> dict:
        """What a bundle's manifest records of the loop: its fields, the policy by name."""
        return {"policy": self.policy.name, "threshold_rule": self.threshold_rule, "lookahead": self.lookahead,
                "spec_width": self.spec_width, **dataclasses.asdict(self.schedule), "slots": self.slots}


@dataclasses.dataclass(frozen=True)
class BakedLoops:
    """A decoding setting compiled into a bundle: one loop per canvas size, and its thresholds (runtime
    inputs of the loop, baked into the bundle's run.sh)."""

    setting: str                 # POLICY[@THRESHOLD], as `--policy` takes it
    specs: tuple[LoopSpec, ...]
    threshold: float | None
    draft_threshold: float

    def manifest(self) -> dict:
        """What a bundle's manifest records of the setting its loops were baked for."""
        first = self.specs[0]
        commit_cutoff, draft_cutoff = cutoffs(self.threshold, self.draft_threshold)
        return {"setting": self.setting, "threshold": self.threshold, "draft_threshold": self.draft_threshold,
                **dataclasses.asdict(first.schedule),
                "commit_cutoff": float(commit_cutoff), "draft_cutoff": float(draft_cutoff)}


def cutoffs(threshold: float | None, draft_threshold: float) -> tuple[np.float32, np.float32]:
    """The loop's two cutoff inputs: the threshold rule's (unused by the fixed schedule) and speculation's."""
    return log_cutoff(threshold if threshold is not None else 1.0), log_cutoff(draft_threshold)


@functools.lru_cache(maxsize=64)  # a bisection of ~30 steps; every generation asks for the same few
def log_cutoff(threshold: float, strict: bool = False) -> np.float32:
    """The smallest float32 log-probability x with exp(float64(x)) >= threshold (`strict`: > threshold): on the
    device, `logp >= cutoff` decides exactly what the host decides comparing exp(logp) with the threshold."""
    def passes(value: np.float32) -> bool:
        probability = np.exp(np.float64(value))
        return bool(probability > threshold if strict else probability >= threshold)

    if passes(np.float32(-np.inf)):
        return np.float32(-np.inf)
    if not passes(np.float32(0.0)):
        return np.float32(np.inf)  # no log-probability passes
    # Non-positive float32 values, as int32 bit patterns, grow with magnitude: bisect the pattern.
    low, high = 0, int(np.float32(-np.inf).view(np.int32) & 0x7FFFFFFF)  # 0.0 passes; -inf does not

    def value_of(bits: int) -> np.float32:
        return np.int32(bits | -0x80000000).view(np.float32) if bits else np.float32(0.0)

    while high - low > 1:  # invariant: passes(low), not passes(high)
        middle = (low + high) // 2
        low, high = (middle, high) if passes(value_of(middle)) else (low, middle)
    return value_of(low)


class LoopInputs(NamedTuple):
    """The compiled loop's runtime inputs, in call order (weights come first, bound by the backend)."""

    prompt: Array                # [slots] int32: the prompt, then anything
    prompt_len: Array            # [] int32
    logit_bias: Array            # [E] float32
    confidence_bias: Array       # [E] float32
    commit_cutoff: Array         # [] float32: the threshold rule's log_cutoff (unused by the fixed schedule)
    draft_cutoff: Array          # [] float32: speculation's log_cutoff (unused without it)


class LoopOutputs(NamedTuple):
    """The compiled loop's outputs, in return order."""

    generated: Array         # [gen_length] int32
    nfe: Array               # [] int32
    commit_nfe: Array        # [gen_length] int32: the pass that committed each position (0-based)
    commit_logp: Array       # [gen_length] float32: its log-probability then
    step_block: Array        # [max_passes] int32, per pass
    step_width: Array        # [max_passes] int32: padded positions computed
    step_real: Array         # [max_passes] int32: real positions computed
    step_useful: Array       # [max_passes] int32
    bad_pass: Array          # [] int32: the pass whose readout was not finite, else NOT_COMMITTED
    bad_position: Array      # [] int32: its first such canvas position


def loop_inputs(prompt: np.ndarray, spec: LoopSpec, biases, threshold: float | None,
                draft_threshold: float) -> LoopInputs:
    padded = np.zeros(spec.slots, np.int32)
    padded[: len(prompt)] = prompt
    commit_cutoff, draft_cutoff = cutoffs(threshold, draft_threshold)
    return LoopInputs(padded, np.asarray(len(prompt), np.int32), biases.logit_bias, biases.confidence_bias,
                      np.asarray(commit_cutoff, np.float32), np.asarray(draft_cutoff, np.float32))
