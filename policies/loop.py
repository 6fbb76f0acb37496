"""The semi-autoregressive host loop: blocks left to right, steps until each block is filled.

Per step: the cache policy computes a window, the sampler turns its readout into (x0, confidence),
the commit rule picks masked positions of the current block, and the canvas takes their tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from llada_jax.errors import LladaError
from llada_jax.readout import check_finite
from policies.canvas import Block, Canvas
from policies.sampling import Sampler
from policies.schedule import FixedSchedule, ThresholdRule, transfer_counts


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Lengths of one generation, validated as LLaDA's reference requires."""

    gen_length: int
    block_length: int
    steps: int

    def __post_init__(self):
        for name in ("gen_length", "block_length", "steps"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise LladaError(f"{name} must be a positive integer, got {value!r}")
        if self.gen_length % self.block_length:
            raise LladaError(f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}")
        if self.steps < self.num_blocks:
            raise LladaError(f"steps={self.steps} is fewer than the {self.num_blocks} blocks (need one step per block at least)")
        if self.steps % self.num_blocks:
            raise LladaError(f"steps={self.steps} is not divisible by the number of blocks ({self.num_blocks})")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def blocks(self, prompt_len: int) -> list[Block]:
        return [Block(b, prompt_len + b * self.block_length, prompt_len + (b + 1) * self.block_length)
                for b in range(self.num_blocks)]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One forward pass of the dense path: what it computed and what it committed (canvas positions)."""

    nfe: int
    block: int
    kind: str                 # "full" or "window"
    width: int                # real positions computed
    slots: int                # positions of the fixed shape, padding included
    useful: int               # computed positions whose prediction the policy could use
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    confidence: tuple[float, ...]
    drafts: int = 0           # of `positions`, committed early in a later block
    revisions: tuple = ()     # (position, old token, new token) changed during this step

    @property
    def utilisation(self) -> float:
        return self.useful / self.slots


@dataclasses.dataclass(frozen=True)
class Result:
    output_ids: np.ndarray     # [gen_length] generated token ids
    nfe: int                   # forward passes
    wall_s: float
    trace: tuple[StepRecord, ...]
    prompt_len: int
    stats: dict = dataclasses.field(default_factory=dict)  # policy counters (side path refreshes, ...)

    @property
    def revisions(self) -> int:
        return sum(len(record.revisions) for record in self.trace)

    @property
    def mean_utilisation(self) -> float:
        return float(np.mean([record.utilisation for record in self.trace])) if self.trace else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.wall_s if self.wall_s > 0 else float("inf")


def decode(backend, prompt_ids: np.ndarray, schedule: Schedule, cache_policy, rule, sampler: Sampler, *,
           mask_id: int, max_len: int, cfg: bool = False, seed: int = 0,
           on_step: Callable[[Canvas, StepRecord], None] | None = None) -> Result:
    """Generate `schedule.gen_length` tokens after `prompt_ids` (already validated on the host)."""
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    canvas = Canvas.start(prompt_ids, schedule.gen_length, mask_id, cfg, max_len)
    state = cache_policy.initial_state(backend, canvas)
    trace: list[StepRecord] = []
    for block in schedule.blocks(canvas.prompt_len):
        counts = transfer_counts(int(canvas.masked[block.start:block.end].sum()), schedule.steps_per_block)
        step = 0
        while not _block_done(canvas, block, step, schedule, cache_policy, rule):
            state, record = _step(backend, canvas, state, block, step, counts, cache_policy, rule, sampler, rng,
                                  len(trace))
            trace.append(record)
            if on_step is not None:
                on_step(canvas, record)
            step += 1
    state, revisions = cache_policy.finish(backend, canvas, state)
    if revisions:
        trace[-1] = dataclasses.replace(trace[-1], revisions=trace[-1].revisions + tuple(revisions))
    return Result(canvas.generated(), len(trace), time.perf_counter() - started, tuple(trace), canvas.prompt_len,
                  cache_policy.stats(state))


def _step(backend, canvas: Canvas, state, block: Block, step: int, counts, cache_policy, rule, sampler, rng,
          nfe: int):
    """One dense step: compute, commit in the current block (and drafts), then the policy's after-work."""
    out, window, state = cache_policy.step(backend, canvas, state, block, step, nfe)
    check_finite(out.readout, window.positions, window.valid, nfe)
    x0, confidence = canvas_wide(canvas, window, *sampler.choose(out.readout, rng))
    useful = cache_policy.useful(window, canvas, block)
    candidates = canvas.masked.copy()
    candidates[: block.start] = False
    candidates[block.end:] = False
    chosen = rule.select(confidence, candidates, step, counts)
    drafts = cache_policy.drafts(x0, confidence, canvas, block)
    committed = np.concatenate([chosen, drafts]).astype(np.int64)
    canvas.write(committed, x0[committed])
    state, revisions = cache_policy.after_commit(backend, canvas, state, block, window, x0, confidence, nfe)
    record = StepRecord(nfe, block.index, "full" if window.valid.size == canvas.slots else "window",
                        int(window.valid.sum()), int(window.valid.size), useful,
                        tuple(int(p) for p in committed), tuple(int(t) for t in x0[committed]),
                        tuple(float(c) for c in confidence[committed]), len(drafts), tuple(revisions))
    return state, record


def _block_done(canvas: Canvas, block: Block, step: int, schedule: Schedule, cache_policy, rule) -> bool:
    """Vanilla's fixed schedule runs exactly steps_per_block steps (as LLaDA's reference does); cached
    decoders, speculation and the threshold rule stop as soon as the block has no mask left (as
    Fast-dLLM does; a block whose masks were all drafted early takes no step at all)."""
    filled = not canvas.masked[block.start:block.end].any()
    if isinstance(rule, FixedSchedule) and not cache_policy.stops_when_filled:
        return step >= schedule.steps_per_block
    return filled


def canvas_wide(canvas: Canvas, window, x0: np.ndarray, confidence: np.ndarray):
    """Spread per-window predictions over canvas positions (confidence -inf where not computed)."""
    x0_all = np.full(canvas.slots, canvas.mask_id, np.int64)
    confidence_all = np.full(canvas.slots, -np.inf)
    real = window.positions[window.valid]
    x0_all[real] = x0[window.valid]
    confidence_all[real] = confidence[window.valid]
    return x0_all, confidence_all


def make_rule(schedule: Schedule, threshold: float | None):
    return FixedSchedule(schedule.steps_per_block) if threshold is None else ThresholdRule(float(threshold))
