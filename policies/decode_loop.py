"""The whole semi-autoregressive decode loop as one pure JAX function of fixed shapes: blocks in a
`lax.while_loop`, steps in another, the canvas and the KV state as loop carry. It calls the decisions
`policies.loop` calls on the host (`policies.decisions`), in the same order, so both give the same tokens
and forward passes (`tests/test_decode_loop.py`); `policies.compiled_loop` says which settings it covers.

Per step: the plan (a full step at a block's start, peeled out of the step loop, or on every step for
vanilla, else a window against the cached K/V), the K/V commit of a full step (prefix-cache keeps the
prefix, dual-cache everything), the commit rule over the block's masks (fixed schedule: the scheduled count
of the best; threshold rule: every candidate at or above the cutoff, and the best), and speculation's
confident drafts.

Candidates are ranked by the step's float32 log-probability, ties to the lower position, as the host ranks
them; a confidence threshold is a log-probability cutoff the host computed
(`policies.loop_io.log_cutoff`). A non-finite readout stops the loop and is reported.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.forward import Context
from llada_jax.model.kv_state import HIDDEN
from llada_jax.model.layout import XLA_LAYOUT, LayoutRule
from llada_jax.model.readout import ReadoutSpec, first_nonfinite
from llada_jax.model.shapes import kv_shape
from llada_jax.model.steps import full_forward, head_rows, read_out, window_forward
from llada_jax.quant.qlinear import tie_scales
from policies.cache_policies import Cached
from policies.decisions import (
    block_going,
    draft_commits,
    fixed_commits,
    ranks,
    read_rows,
    scheduled_count,
    speculative_window,
    threshold_commits,
)
from policies.loop_io import NOT_COMMITTED, LoopInputs, LoopOutputs, LoopSpec

ARGMAX = ReadoutSpec(kind="argmax")


class Carry(NamedTuple):
    tokens: jax.Array        # [S] the canvas
    keys: jax.Array | None   # [N, 1, S, K, hd] cached K (None for vanilla)
    values: jax.Array | None
    filled: jax.Array        # [S] bool: slots holding K/V (vanilla: positions a full step computed)
    nfe: jax.Array           # forward passes so far
    commit_nfe: jax.Array    # [S]
    commit_logp: jax.Array   # [S]
    steps: jax.Array         # [4, max_passes]: block, padded width, real width, useful per pass
    bad: jax.Array           # [2]: (pass, canvas position) of a non-finite readout, else NOT_COMMITTED


class Computed(NamedTuple):
    """One dense step over the canvas: predictions spread over canvas positions (mask / -inf where not
    computed), the KV state after its commit, and what the trace records."""

    x0: jax.Array
    logp: jax.Array
    keys: jax.Array | None
    values: jax.Array | None
    filled: jax.Array
    width: jax.Array
    computed: jax.Array      # [S] bool: real positions computed
    bad_position: jax.Array  # first non-finite position in window order, else NOT_COMMITTED


class Block(NamedTuple):
    index: jax.Array
    start: jax.Array
    in_block: jax.Array      # [S] bool
    drafts: jax.Array        # [S] bool: speculation's draft region
    masked_at_start: jax.Array


@functools.partial(jax.jit, static_argnames=("config", "spec", "kv_dtype", "layout_rule"))
def decode_loop(params: dict, inputs: LoopInputs, *, config: LLaDAConfig, spec: LoopSpec, kv_dtype,
                layout_rule: LayoutRule = XLA_LAYOUT) -> LoopOutputs:
    """Generate `spec.schedule.gen_length` tokens after `inputs.prompt[:prompt_len]` (validated on the host).
    `layout_rule`: see `model.decoder_layer` (`llada_jax.model.layout`; IREE exports pass their target's)."""
    s = spec.slots
    positions = jnp.arange(s)
    length = jnp.asarray(inputs.prompt_len) + spec.schedule.gen_length
    cached = spec.caches
    zeros = jnp.zeros(kv_shape(config, 1, s), kv_dtype) if cached else None
    carry = Carry(jnp.where(positions < inputs.prompt_len, inputs.prompt, config.mask_token_id).astype(jnp.int32),
                  zeros, zeros, jnp.zeros(s, bool), jnp.int32(0), jnp.full(s, NOT_COMMITTED, jnp.int32),
                  jnp.full(s, -jnp.inf, jnp.float32), jnp.zeros((4, spec.max_passes), jnp.int32),
                  jnp.full(2, NOT_COMMITTED, jnp.int32))
    run = _Run(params, inputs, config, spec, positions, length, layout_rule)

    def more_blocks(state):
        b, carry = state
        return (b < spec.schedule.num_blocks) & (carry.bad[0] == NOT_COMMITTED)

    def one_block(state):
        b, carry = state
        carry = run.block(b, carry)
        return (run.next_block(b, carry.tokens) if spec.lookahead else b + 1), carry

    _, carry = jax.lax.while_loop(more_blocks, one_block, (jnp.int32(0), carry))
    generated = jax.lax.dynamic_slice(carry.tokens, (inputs.prompt_len,), (spec.schedule.gen_length,))
    step_block, step_width, step_real, step_useful = carry.steps
    return LoopOutputs(
        generated=generated, nfe=carry.nfe,
        commit_nfe=jax.lax.dynamic_slice(carry.commit_nfe, (inputs.prompt_len,), (spec.schedule.gen_length,)),
        commit_logp=jax.lax.dynamic_slice(carry.commit_logp, (inputs.prompt_len,), (spec.schedule.gen_length,)),
        step_block=step_block, step_width=step_width, step_real=step_real, step_useful=step_useful,
        bad_pass=carry.bad[0], bad_position=carry.bad[1])


class _Run(NamedTuple):
    """What every step of one generation shares (traced values and static settings)."""

    params: dict
    inputs: LoopInputs
    config: LLaDAConfig
    spec: LoopSpec
    positions: jax.Array
    length: jax.Array
    layout_rule: LayoutRule

    def masked(self, tokens):
        """[S] positions of the generated part still holding the mask."""
        generated = (self.positions >= self.inputs.prompt_len) & (self.positions < self.length)
        return generated & (tokens == self.config.mask_token_id)

    def block(self, b, carry: Carry) -> Carry:
        spec = self.spec
        start = self.inputs.prompt_len + b * spec.schedule.block_length
        end = start + spec.schedule.block_length
        in_block = (self.positions >= start) & (self.positions < end)
        draft_end = jnp.minimum(end + spec.lookahead * spec.schedule.block_length, self.length)
        drafts = (self.positions >= end) & (self.positions < draft_end)
        block = Block(b, start, in_block, drafts, jnp.sum(self.masked(carry.tokens) & in_block))

        def more_steps(state):
            step, carry = state
            going = block_going(jnp.any(self.masked(carry.tokens) & in_block), step, spec.schedule.steps_per_block,
                                spec.threshold_rule or spec.stops_when_filled, spec.schedule.block_length)
            return going & (carry.bad[0] == NOT_COMMITTED)

        def one_step(state):
            step, carry = state
            return step + 1, self.step(block, step, carry, full=not spec.caches)

        state = (jnp.int32(0), carry)
        if spec.caches:
            # The cached decoders' first pass (the full forward that fills the cache) is peeled out of the
            # step loop: IREE 3.13's multithreaded driver fails on a branch on the step inside it. A block
            # entered holds a mask (`next_block`), so the pass always runs.
            state = (jnp.int32(1), self.step(block, 0, carry, full=True))
        return jax.lax.while_loop(more_steps, one_step, state)[1]

    def next_block(self, b, tokens):
        """The first block after `b` still holding a mask, else `num_blocks`: speculation's drafts may have
        filled the blocks between, which take no step (as in the host loop)."""
        schedule = self.spec.schedule
        blocks = jnp.arange(schedule.num_blocks)
        offsets = self.positions - self.inputs.prompt_len
        block_of = jnp.where(self.masked(tokens), offsets // schedule.block_length, -1)
        waiting = (blocks > b) & jnp.any(block_of[None, :] == blocks[:, None], axis=1)
        return jnp.where(jnp.any(waiting), jnp.argmax(waiting), schedule.num_blocks).astype(jnp.int32)

    def step(self, block: Block, step, carry: Carry, full: bool) -> Carry:
        """One pass: a full forward (`full`) or a window over the cache."""
        masked = self.masked(carry.tokens)
        run = self._replace(params=tie_scales(self.params, carry.tokens))
        out = run.full(block, carry, masked) if full else run.window(block, carry, masked)
        chosen = self.chosen(block, step, masked, out.logp)
        commit = chosen | draft_commits(block.drafts, masked, out.logp >= self.inputs.draft_cutoff)
        failed = out.bad_position != NOT_COMMITTED
        commit = commit & ~failed
        useful = jnp.sum(out.computed & masked & (block.in_block | block.drafts))
        record = jnp.stack([block.index, out.width, jnp.sum(out.computed), useful]).astype(jnp.int32)
        return Carry(jnp.where(commit, out.x0, carry.tokens), out.keys, out.values, out.filled, carry.nfe + 1,
                     jnp.where(commit, carry.nfe, carry.commit_nfe), jnp.where(commit, out.logp, carry.commit_logp),
                     jnp.where(jnp.arange(self.spec.max_passes) == carry.nfe, record[:, None], carry.steps),
                     jnp.where(failed, jnp.stack([carry.nfe, out.bad_position]), carry.bad))

    def chosen(self, block: Block, step, masked, logp):
        """The block's masks committed by the rule."""
        candidates = masked & block.in_block
        rank = ranks(jnp, logp, candidates)
        if self.spec.threshold_rule:
            return threshold_commits(rank, candidates, logp >= self.inputs.commit_cutoff)
        count = scheduled_count(block.masked_at_start, self.spec.schedule.steps_per_block, step)
        return fixed_commits(rank, candidates, count)

    def full(self, block: Block, carry: Carry, masked) -> Computed:
        valid = self.positions < self.length
        out = full_forward(self.params, carry.tokens[None], valid[None], self.config, self.layout_rule)
        needed = None if self.spec.lookahead else read_rows(jnp, block.in_block, masked)  # drafts: every row
        x0, logp, bad = self.read(out.hidden, self.positions, valid, needed)
        cached_keys, cached_values, filled = carry.keys, carry.values, carry.filled
        if isinstance(self.spec.policy, Cached):
            keep = valid & self.spec.policy.kv_kept(self.positions, block.start)
            cached_keys = _keep(keep, out.keys, carry.keys)
            cached_values = _keep(keep, out.values, carry.values)
            filled = filled | keep
        else:
            # Vanilla reads no K/V; yet IREE 3.13 fails on its loop ("indirect buffer reference slot 0 is out
            # of range", local-sync) unless this carry changes. Not understood; the bundle tests run it.
            filled = filled | valid
        return Computed(x0, logp, cached_keys, cached_values, filled, jnp.int32(self.spec.slots), valid, bad)

    def read(self, hidden, row_pos, row_valid, needed) -> tuple:
        """(x0, logp) over canvas positions (mask / -inf where not read out) and the first non-finite
        position, the LM head run on the rows of `hidden` `[1, W, D]` whose prediction is `needed` `[W]`
        (`decisions.read_rows`; None: every row), in the declared width covering them, as the
        host loop's plans read out (`policies.policy.StepPlan.read_columns`). Row i is canvas position
        `row_pos[i]`, real where `row_valid[i]`."""
        rows = row_pos.shape[0]
        slot = jnp.arange(rows)
        if needed is None:
            return self._read_rows(hidden, row_pos, row_valid, slot, rows)
        count = jnp.sum(needed)
        widths = self.spec.head_widths(rows)
        order = jnp.where(needed, jnp.cumsum(needed) - 1, rows)
        at = jnp.sum((order[None, :] == slot[:, None]) * slot[None, :], axis=1)  # [W]: row of the i-th needed
        at = jnp.where(slot < count, at, at[count - 1])
        branches = [functools.partial(self._read_rows, hidden, row_pos, slot < count, at[:width], width)
                    for width in widths]
        which = jnp.sum(count > jnp.asarray(widths[:-1], jnp.int32)) if len(widths) > 1 else 0
        return _switch(which, branches)

    def _read_rows(self, hidden, row_pos, real, at, width: int) -> tuple:
        """The readout of `width` rows `at` of `hidden` (real where `real`), spread over canvas positions."""
        out = read_out(self.params, head_rows(hidden, at), jnp.float32(0.0), self.inputs.logit_bias,
                       self.inputs.confidence_bias, ARGMAX, self.layout_rule)
        x0, logp, real, pos = out.x0[0], out.logp[0], real[:width], row_pos[at]
        spread = (pos[:, None] == self.positions[None, :]) & real[:, None]  # [R, S]
        return (jnp.where(jnp.any(spread, axis=0), jnp.sum(spread * x0[:, None], axis=0), self.config.mask_token_id),
                jnp.max(jnp.where(spread, logp[:, None], -jnp.inf), axis=0), _first_nonfinite(logp, real, pos))

    def window(self, block: Block, carry: Carry, masked) -> Computed:
        """The block (prefix-cache: and everything after it; speculation: and its first drafts) against
        the cached K/V of every other filled position."""
        widths = self.spec.window_widths()
        distinct = sorted(set(widths))
        branches = [functools.partial(self._window_of, width, carry, block, masked) for width in distinct]
        which = jnp.asarray([distinct.index(width) for width in widths], jnp.int32)[block.index]
        computed = _switch(which, branches)
        return Computed(*computed[:2], carry.keys, carry.values, carry.filled, *computed[2:])

    def _window_of(self, width: int, carry: Carry, block: Block, masked) -> tuple:
        """(x0, logp, width, computed, bad position) of a window step of `width` slots."""
        slot = jnp.arange(width)
        policy, length = self.spec.policy, self.spec.schedule.block_length
        assert isinstance(policy, Cached) and carry.keys is not None and carry.values is not None, \
            "only a cache policy runs window steps"
        window_pos = block.start + slot
        window_valid = window_pos < policy.window_end(block.start + length, self.length)
        if self.spec.lookahead and not policy.window_to_end:  # the block's drafts fill the slots after it
            window_pos, window_valid = speculative_window(jnp, block.start, length, block.drafts & masked, width)
        window_pos = jnp.where(window_valid, window_pos, 0).astype(jnp.int32)
        at = (window_pos[:, None] == self.positions[None, :]) & window_valid[:, None]  # [W, S]
        computed = jnp.any(at, axis=0)
        visible = (self.positions < self.length) & carry.filled & ~computed
        context = Context(carry.keys, carry.values, jnp.where(visible, 0.0, HIDDEN).astype(jnp.float32)[None])
        out = window_forward(self.params, context, carry.tokens[window_pos][None], window_pos[None],
                             window_valid[None], self.config, self.layout_rule)
        in_reads = (slot < self.spec.schedule.block_length) & window_valid  # the block: the window's first columns
        needed = None if self.spec.lookahead else read_rows(jnp, in_reads, masked[window_pos])
        x0, logp, bad = self.read(out.hidden, window_pos, window_valid, needed)
        return x0, logp, jnp.int32(width), computed, bad


def _switch(index, branches):
    """`lax.switch` as a chain of two-way conds: IREE 3.13 runs a three-way case inside a loop wrongly."""
    if len(branches) == 1:
        return branches[0]()
    return jax.lax.cond(index == 0, branches[0], lambda: _switch(index - 1, branches[1:]))


def _keep(keep, proposed, cached):
    return jnp.where(keep[None, None, :, None, None], proposed.astype(cached.dtype), cached)


def _first_nonfinite(logp, valid, positions):
    """The canvas position of the first valid entry whose log-probability is NaN or +inf (as
    `readout.check_finite` finds it on the host), else NOT_COMMITTED."""
    return first_nonfinite(jnp, logp[None], valid, positions, NOT_COMMITTED).astype(jnp.int32)
