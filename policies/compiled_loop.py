"""The decode loop compiled into one function, from the decoding side: which settings it covers, the loops
a bundle bakes for a setting, and the host loop's `Result` rebuilt from its outputs. No JAX here: bundles
run it through IREE.

The compiled loop (`policies.decode_loop`) runs the same decoders as the host loop (`policies.loop`):
vanilla, prefix-cache and dual-cache, optionally with multi-block speculation, under LLaDA's fixed
schedule or the threshold rule, at temperature 0, low-confidence remasking, without CFG. Revision's side
path, weight staging, CFG, temperature > 0 and random remasking stay on the host loop.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from llada_jax.model.readout import nonfinite_error
from llada_jax.system.errors import LladaError
from policies.cache_policies import CachePolicy
from policies.decisions import ranks
from policies.loop import Result, StepRecord
from policies.loop_io import NOT_COMMITTED, BakedLoops, LoopOutputs, LoopSpec, loop_inputs
from policies.registry import make_policy
from policies.rule import Rule
from policies.sampling import Sampler
from policies.schedule import FixedSchedule, Schedule, ThresholdRule, in_rank_order, make_rule
from policies.speculative import Speculative


def loop_spec(policy, rule: Rule, sampler, cfg: bool, schedule: Schedule, slots: int) -> LoopSpec | None:
    """The compiled loop of this setting, or None when only the host loop runs it (Dream's schedule too)."""
    base = cache_policy_of(policy)
    if base is None or not loop_covers(policy, sampler, cfg) or not isinstance(rule, (FixedSchedule, ThresholdRule)):
        return None
    lookahead, width = (policy.lookahead, policy.width) if isinstance(policy, Speculative) else (0, 0)
    return LoopSpec(policy=base, threshold_rule=isinstance(rule, ThresholdRule), lookahead=lookahead,
                    spec_width=width, schedule=schedule, slots=slots)


def loop_covers(policy, sampler: Sampler = Sampler(), cfg: bool = False) -> bool:
    """A cache policy, or speculation over one (not revision: its side path runs on the host), at
    temperature 0 with low-confidence remasking and no CFG."""
    if cfg or sampler.temperature != 0.0 or sampler.remasking != "low_confidence" or sampler.dream_confidence:
        return False
    return cache_policy_of(policy) is not None


def cache_policy_of(policy) -> CachePolicy | None:
    """The cache policy the compiled loop runs for `policy` (itself, or speculation's base); None: not one."""
    base = policy.base if isinstance(policy, Speculative) else policy
    return base if isinstance(base, CachePolicy) else None


def baked_loops(policy: str, threshold: float | None, gen_length: int, block_length: int, steps: int,
                slot_sizes) -> BakedLoops:
    """The compiled loops a bundle needs to run this setting at temperature 0: one per canvas size that can
    hold a prompt and the generated tokens. A setting only the host loop runs is a one-line error."""
    schedule = Schedule(int(gen_length), int(block_length), int(steps))
    decoding_policy = make_policy(policy)
    rule = make_rule(schedule, threshold)
    sizes = [size for size in sorted(set(slot_sizes)) if size > schedule.gen_length]
    if not sizes:
        raise LladaError(f"gen_length={schedule.gen_length} leaves no room for a prompt in canvases of at most "
                         f"{max(slot_sizes)} positions (raise --max-len)")
    specs = [loop_spec(decoding_policy, rule, Sampler(), False, schedule, size) for size in sizes]
    covered = [spec for spec in specs if spec is not None]
    if len(covered) < len(specs):
        raise LladaError(f"policy {policy!r} runs only on the host loop: the compiled loop covers vanilla, "
                         "prefix-cache and dual-cache (+speculative)")
    setting = policy if threshold is None else f"{policy}@{threshold}"
    return BakedLoops(setting, tuple(covered), threshold, draft_threshold_of(decoding_policy))


def result_from(outputs: LoopOutputs, spec: LoopSpec, prompt_len: int, wall_s: float) -> Result:
    """The `Result` the host loop would have returned: the trace rebuilt pass by pass (current-block
    commits in rank order, then drafts in position order, as `policies.loop` records them)."""
    nfe = int(outputs.nfe)
    committed_by = np.asarray(outputs.commit_nfe)
    logp = np.asarray(outputs.commit_logp, np.float64)
    generated = np.asarray(outputs.generated, np.int64)
    order = np.full(spec.slots, -np.inf)  # the rank key over canvas positions, as the step had it
    order[prompt_len: prompt_len + spec.schedule.gen_length] = logp
    trace = []
    for n in range(nfe):
        block = int(outputs.step_block[n])
        block_end = prompt_len + (block + 1) * spec.schedule.block_length
        mine = np.zeros(spec.slots, bool)
        mine[prompt_len: prompt_len + spec.schedule.gen_length] = committed_by == n
        lo = block_end - spec.schedule.block_length
        chosen = lo + in_rank_order(ranks(np, order[lo:block_end], mine[lo:block_end]), mine[lo:block_end])
        drafts = np.flatnonzero(mine & (np.arange(spec.slots) >= block_end))
        positions = np.concatenate([chosen, drafts])
        offsets = positions - prompt_len
        width, real, useful = int(outputs.step_width[n]), int(outputs.step_real[n]), int(outputs.step_useful[n])
        trace.append(StepRecord(n, block, "full" if width == spec.slots else "window", real, width, useful,
                                tuple(int(p) for p in positions), tuple(int(t) for t in generated[offsets]),
                                tuple(float(c) for c in np.exp(logp[offsets])), len(drafts),
                                head_rows=spec.head_rows(width, useful),
                                read_rows=real if spec.lookahead else max(useful, 1)))
    return Result(generated, nfe, wall_s, tuple(trace), prompt_len, {"loop": "compiled"})


def run_compiled(compiled, prompt: np.ndarray, spec: LoopSpec, biases, threshold: float | None,
                 draft_threshold: float) -> Result:
    """One generation through a backend's compiled loop."""
    return call_loop(compiled, lambda: loop_inputs(prompt, spec, biases, threshold, draft_threshold),
                     lambda outputs: result_from(outputs, spec, len(prompt), 0.0))


def call_loop(compiled, inputs: Callable, result: Callable) -> Result:
    """`result(compiled(inputs()))`, timed (`wall_s`, `stats["step_call_seconds"]`); a non-finite readout the
    loop reported is the host loop's error. Both compiled loops (LLaDA's, block diffusion's) run through it."""
    started = time.perf_counter()
    loop_in = inputs()
    called = time.perf_counter()
    outputs = compiled(loop_in)
    call_s = time.perf_counter() - called
    if int(outputs.bad_pass) != NOT_COMMITTED:
        raise nonfinite_error(int(outputs.bad_pass), int(outputs.bad_position))
    done = result(outputs)
    return dataclasses.replace(done, wall_s=time.perf_counter() - started,
                               stats={**done.stats, "step_call_seconds": call_s})


def draft_threshold_of(policy) -> float:
    return policy.draft_threshold if isinstance(policy, Speculative) else 1.0

