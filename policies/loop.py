"""The semi-autoregressive host loop: blocks left to right, steps until each block is filled.

Per step: the policy plans what to compute, the backend computes it, the sampler turns its readout into
(x0, confidence), the policy's reviser merges its side work, the plan's K/V are committed, the commit rule
picks masked positions of the current block (plus confident drafts) and the canvas takes their tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Generator, Literal

import numpy as np

from llada_jax.model import kv_state
from llada_jax.model.readout import check_finite, read_width
from policies.backend import BackendCall
from policies.canvas import Block, Canvas
from policies.canvas_steps import canvas_wide, commit_call, window_call
from policies.decisions import block_going, ranks
from policies.policy import Policy, Reviser, StepPlan, write_revisions
from policies.rule import Rule
from policies.sampling import Sampler
from policies.schedule import Schedule, in_rank_order
from policies.step_batcher import StepBatcher


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One forward pass of the dense path: what it computed and what it committed (positions in the
    unpadded canvas: the prompt from 0, whatever left padding a batch gave the row)."""

    nfe: int
    block: int
    kind: Literal["full", "window"]
    width: int                # real positions computed
    shape_width: int          # positions of the fixed shape, padding included
    useful: int               # computed positions whose prediction the policy could use
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    confidence: tuple[float, ...]
    drafts: int = 0           # of `positions`, committed early in a later block
    revisions: tuple = ()     # (position, old token, new token) changed during this step
    head_rows: int | None = None  # positions the LM head ran on (padding included); None: all shape_width
    read_rows: int | None = None  # real positions whose predictions the step returned; None: all `width`

    @property
    def utilisation(self) -> float:
        return self.useful / self.shape_width


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


@dataclasses.dataclass
class LoopState:
    """Where one generation stands: its canvas, KV state (None until a step reads or commits K/V), the block
    and the step within it, and the trace (one record per forward pass so far)."""

    canvas: Canvas
    kv: kv_state.KVState | None = None
    block: Block | None = None
    step: int = 0
    trace: list[StepRecord] = dataclasses.field(default_factory=list)

    @property
    def nfe(self) -> int:
        return len(self.trace)


Steps = Generator[BackendCall, object, Result]  # a generation: its step calls, each sent back its result


def decode(backend, prompt_ids: np.ndarray, schedule: Schedule, policy: Policy, rule: Rule, sampler: Sampler, *,
           mask_id: int, max_len: int, cfg: bool = False, seed: int = 0, offset: int = 0,
           on_step: Callable[[Canvas, StepRecord], None] | None = None) -> Result:
    """Generate `schedule.gen_length` tokens after `prompt_ids` (already validated on the host), the
    canvas left-padded by `offset` columns (a batch's alignment), each step call run on `backend` as it
    comes. Trace positions are unpadded."""
    return run_alone(backend, decode_steps(backend, prompt_ids, schedule, policy, rule, sampler, mask_id=mask_id,
                                           max_len=max_len, cfg=cfg, seed=seed, offset=offset, on_step=on_step))


def decode_steps(backend, prompt_ids: np.ndarray, schedule: Schedule, policy: Policy, rule: Rule, sampler: Sampler, *,
                 mask_id: int, max_len: int, cfg: bool = False, seed: int = 0, offset: int = 0,
                 on_step: Callable[[Canvas, StepRecord], None] | None = None) -> Steps:
    """`decode` as a generator of its step calls (`full`, `window`, `commit`), so that a driver can run many
    generations' calls together; `backend` serves the rest (allocating the KV state, revision's side path)."""
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    state = LoopState(Canvas.start(prompt_ids, schedule.gen_length, mask_id, cfg, max_len, offset))
    canvas = state.canvas
    with policy.side_path(backend, canvas) as reviser:
        for block in schedule.blocks(canvas.prompt_len):
            state.block, state.step = block, 0
            masked_at_start = int(canvas.masked[block.start:block.end].sum())
            while not _block_done(canvas, block, state.step, policy, rule, schedule.steps_per_block):
                plan = policy.plan(canvas, block, state.step, state.kv)
                if state.kv is None and (plan.keep_kv is not None or not plan.full):
                    state.kv = backend.empty_state(canvas.tokens.shape[0], canvas.padded_length)
                record = yield from _step(state, plan, reviser, rule.commits, sampler, rng, masked_at_start)
                state.trace.append(record)
                if on_step is not None:
                    on_step(canvas, record)
                state.step += 1
        state.kv, revisions = reviser.finish(state.kv)
        write_revisions(canvas.tokens, revisions)
        stats = reviser.stats()
    trace = state.trace
    if revisions:
        trace[-1] = dataclasses.replace(trace[-1], revisions=trace[-1].revisions + unpadded(canvas, revisions))
    return Result(canvas.generated(), len(trace), time.perf_counter() - started, tuple(trace),
                  canvas.prompt_len - canvas.offset, stats)


def run_rows(backend, rows: list[Steps]) -> tuple[list[Result], StepBatcher]:
    """Drive generations together on `backend`, their calls stacked where they share a shape (a lone call runs
    as it is); each result with `step_call_seconds`, the time in the calls it took part in. A row's error is
    raised once every row has stopped (the others run to the end); an interrupt closes every row first."""
    batcher = StepBatcher(backend)
    ends: list[tuple] = [()] * len(rows)  # each row's (result, error, seconds) once it ends
    for index, steps in enumerate(rows):
        batcher.add(steps, lambda *end, index=index: ends.__setitem__(index, end))
    try:
        batcher.run()
    except BaseException:  # Ctrl-C: close every row (its side path too), then let it through
        batcher.cancel()
        raise
    failed = next((error for _, error, _ in ends if error is not None), None)
    if failed is not None:
        raise failed
    return [with_call_seconds(result, seconds) for result, _, seconds in ends], batcher


def run_alone(backend, steps: Steps) -> Result:
    """Drive one generation, each of its step calls run on `backend` as it comes."""
    return run_rows(backend, [steps])[0][0]


def with_call_seconds(result: Result, seconds: float) -> Result:
    """The result with `step_call_seconds`: the time its step calls took (the rest of its wall time is the host
    loop's own work)."""
    return dataclasses.replace(result, stats={**result.stats, "step_call_seconds": seconds})


def unpadded(canvas: Canvas, revisions) -> tuple:
    """Revisions (column, old, new) with the column as the position in the unpadded canvas."""
    return tuple((int(column) - canvas.offset, old, new) for column, old, new in revisions)


def dense_step(canvas: Canvas, kv, plan: StepPlan, reviser: Reviser, nfe: int):
    """Compute the plan, merge the reviser's side work (it ran beside this step) and write its revisions, commit
    the plan's K/V.
    Returns (step output, window, the window's read-out part, KV state, revisions the merge made)."""
    window = plan.window(canvas)
    reads = plan.read_columns(window, canvas)
    inputs = canvas.tokens[:, window.positions]  # a copy (fancy indexing): the tokens the step ran on
    if plan.full:
        out = yield BackendCall("full", (canvas.tokens, canvas.valid, reads))
    else:
        out = yield window_call(canvas, kv, window, reads)
    read = window.columns(reads)
    check_finite(out.readout, read.positions, read.valid, nfe)
    kv, revisions = reviser.merge(kv, nfe)
    write_revisions(canvas.tokens, revisions)
    if plan.keep_kv is not None:
        kv = yield commit_call(kv, window, plan.keep_kv[window.positions], out, inputs, nfe)
    return out, window, read, kv, revisions


def _step(state: LoopState, plan: StepPlan, reviser: Reviser, commits: Callable, sampler, rng, masked_at_start: int):
    """One step: the dense step, then token commits in the block (and drafts), then the next side job."""
    canvas, block, nfe = state.canvas, state.block, state.nfe
    assert block is not None, "a step runs inside a block"
    out, window, read, state.kv, revisions = yield from dense_step(canvas, state.kv, plan, reviser, nfe)
    x0, confidence, order = sampler.choose(out.readout, rng)
    order = canvas_wide(canvas, read, x0, order)[1]
    x0, confidence = canvas_wide(canvas, read, x0, confidence)
    useful = plan.useful(window, canvas, block)
    lo, hi = block.start, block.end
    candidates = canvas.masked[lo:hi]
    rank = ranks(np, order[lo:hi], candidates)
    chosen = lo + in_rank_order(rank, commits(rank, candidates, confidence[lo:hi], state.step, masked_at_start))
    drafts = plan.draft_positions(confidence, canvas)
    committed = np.concatenate([chosen, drafts]).astype(np.int64)
    canvas.write(committed, x0[committed])
    reviser.submit(state.kv, window, confidence, nfe)
    return StepRecord(nfe=nfe, block=block.index,
                      kind="full" if window.valid.size == canvas.padded_length else "window",
                      width=int(window.valid.sum()), shape_width=int(window.valid.size), useful=useful,
                      positions=tuple(int(p) - canvas.offset for p in committed),
                      tokens=tuple(int(t) for t in x0[committed]),
                      confidence=tuple(float(c) for c in confidence[committed]), drafts=len(drafts),
                      revisions=unpadded(canvas, revisions), head_rows=read_width(read.valid.size, window.valid.size),
                      read_rows=int(read.valid.sum()))


def _block_done(canvas: Canvas, block: Block, step: int, policy: Policy, rule: Rule, steps_per_block: int) -> bool:
    """Vanilla's fixed schedule runs exactly steps_per_block steps (as LLaDA's reference does); cached
    decoders, speculation and the threshold rule stop as soon as the block has no mask left (as
    Fast-dLLM does; a block whose masks were all drafted early takes no step at all)."""
    stops = rule.fixed_steps is None or policy.stops_when_filled
    return not block_going(canvas.masked[block.start:block.end].any(), step, steps_per_block, stops,
                           block.end - block.start)
