"""The block-diffusion decode loop (LLaDA2.0, LLaDA2.1) as one pure JAX function of fixed shapes: the host
loop of `policies.block_diffusion` as it runs on XLA, pass for pass (the folded block cache, speculation's
drafts, 2.1's edits and its bound), so both give the same tokens, passes and trace
(`tests/test_block_loop.py`); `policies.block_loop_io` holds its spec, inputs and outputs.

The KV state's slots before a window's start hold finished blocks. A pass's window leads with the pending
finished block when there is one (its K/V are committed from that pass, its rows not read out), then the
current block and up to `lookahead` following ones, block-causal inside: two window shapes, one branch each.
The canvas carries `read_width` padding slots, so every window slice fits.
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
from llada_jax.model.steps import head_rows, read_out, window_forward
from llada_jax.quant.qlinear import tie_scales
from policies.block_loop_io import BlockLoopInputs, BlockLoopOutputs, BlockLoopSpec
from policies.decisions import draft_commits, ranks, share_commits
from policies.loop_io import NOT_COMMITTED

ARGMAX = ReadoutSpec(kind="argmax")
NONE = -1  # no pending block


class Carry(NamedTuple):
    tokens: jax.Array        # [S + R] the canvas, then padding
    keys: jax.Array          # [N, 1, S, K, hd]: finished blocks' K
    values: jax.Array
    pending: jax.Array       # the finished block (its first position) whose K/V the next pass commits, or NONE
    nfe: jax.Array           # denoising passes so far
    cache_passes: jax.Array
    bounded: jax.Array       # 2.1 blocks stopped by the bound
    records: "Records"
    bad: jax.Array           # [2]: (pass, canvas position) of a non-finite readout, else NOT_COMMITTED


class Records(NamedTuple):
    """The per-pass outputs (`BlockLoopOutputs`): row n is pass n."""

    pass_block: jax.Array
    pass_width: jax.Array
    pass_rows: jax.Array
    written: jax.Array
    x0: jax.Array
    logp: jax.Array
    edited: jax.Array
    old: jax.Array


class Pass(NamedTuple):
    """One denoising pass's predictions over its read rows and what the trace records of its shape."""

    x0: jax.Array            # [R]
    logp: jax.Array          # [R]
    width: jax.Array         # positions computed
    rows: jax.Array          # rows that are real canvas positions (the block and the drafts that fit)
    bad_position: jax.Array


@functools.partial(jax.jit, static_argnames=("config", "spec", "kv_dtype", "layout_rule"))
def block_loop(params: dict, inputs: BlockLoopInputs, *, config: LLaDAConfig, spec: BlockLoopSpec, kv_dtype,
               layout_rule: LayoutRule = XLA_LAYOUT) -> BlockLoopOutputs:
    """Generate `spec.gen_length` tokens after `inputs.prompt[:prompt_len]` (validated on the host)."""
    b, s, r, passes = spec.block_length, spec.slots, spec.read_width, spec.max_passes
    prompt_len = jnp.asarray(inputs.prompt_len, jnp.int32)
    canvas = jnp.concatenate([inputs.prompt, jnp.zeros(r, jnp.int32)])
    positions = jnp.arange(s + r)
    zeros = jnp.zeros(kv_shape(config, 1, s), kv_dtype)
    per_pass = jnp.zeros(passes, jnp.int32)
    records = Records(per_pass, per_pass, per_pass, jnp.zeros((passes, r), bool),
                      jnp.zeros((passes, r), jnp.int32), jnp.zeros((passes, r), jnp.float32),
                      jnp.zeros((passes, b), bool), jnp.zeros((passes, b), jnp.int32))
    carry = Carry(jnp.where(positions < prompt_len, canvas, config.mask_token_id).astype(jnp.int32), zeros, zeros,
                  jnp.int32(NONE), jnp.int32(0), jnp.int32(0), jnp.int32(0), records,
                  jnp.full(2, NOT_COMMITTED, jnp.int32))
    length = (prompt_len + spec.gen_length + b - 1) // b * b
    run = _Run(params, inputs, config, spec, layout_rule, length)
    whole, last = prompt_len // b, length // b - 1  # the prompt's whole blocks are final from the start

    def more_blocks(state):
        block, carry = state
        return (block <= last) & (carry.bad[0] == NOT_COMMITTED)

    def one_block(state):
        block, carry = state
        carry = (run.edit_block if spec.editing else run.schedule_block)(carry, block, block >= whole)
        return block + 1, jax.lax.cond(block < last, lambda: run.finished(carry, block * b), lambda: carry)

    _, carry = jax.lax.while_loop(more_blocks, one_block, (jnp.int32(0), carry))
    return BlockLoopOutputs(generated=jax.lax.dynamic_slice(carry.tokens, (prompt_len,), (spec.gen_length,)),
                            nfe=carry.nfe, cache_passes=carry.cache_passes, bounded_blocks=carry.bounded,
                            bad_pass=carry.bad[0], bad_position=carry.bad[1], **carry.records._asdict())


class _Run(NamedTuple):
    """What every pass of one generation shares (traced values and static settings)."""

    params: dict
    inputs: BlockLoopInputs
    config: LLaDAConfig
    spec: BlockLoopSpec
    layout_rule: LayoutRule
    length: jax.Array        # the canvas: prompt + gen_length in whole blocks

    def block_tokens(self, carry: Carry, lo):
        return jax.lax.dynamic_slice(carry.tokens, (lo,), (self.spec.block_length,))

    def forward(self, carry: Carry, start, width: int, valid, blocks):
        """The layers over `width` canvas positions from `start` against the finished blocks before it."""
        context = Context(carry.keys, carry.values,
                          jnp.where(jnp.arange(self.spec.slots) < start, 0.0, HIDDEN).astype(jnp.float32)[None])
        params = tie_scales(self.params, carry.tokens)
        ids = jax.lax.dynamic_slice(carry.tokens, (start,), (width,))
        return window_forward(params, context, ids[None], (start + jnp.arange(width))[None], valid[None], self.config,
                              self.layout_rule, blocks)

    def commit_kv(self, carry: Carry, out, lo) -> Carry:
        """The window's first block of K/V written at `lo`."""
        b = self.spec.block_length
        def written(cache, proposed):
            return jax.lax.dynamic_update_slice_in_dim(cache, proposed[:, :, :b].astype(cache.dtype), lo, axis=2)

        return carry._replace(keys=written(carry.keys, out.keys), values=written(carry.values, out.values))

    def cache_pass(self, carry: Carry, lo) -> Carry:
        """A pass that only computes the finished block at `lo` and caches its K/V."""
        b = self.spec.block_length
        out = self.forward(carry, lo, b, jnp.ones(b, bool), None)
        return self.commit_kv(carry, out, lo)._replace(cache_passes=carry.cache_passes + 1)

    def finished(self, carry: Carry, lo) -> Carry:
        """The block at `lo` is final: the next pass caches it (a pending one no pass took is cached now)."""
        carry = jax.lax.cond(carry.pending != NONE, lambda: self.cache_pass(carry, carry.pending), lambda: carry)
        return carry._replace(pending=jnp.asarray(lo, jnp.int32))

    def predict(self, carry: Carry, lo) -> tuple[Carry, Pass]:
        """A denoising pass over the block at `lo` and its drafts, folding the pending block in."""
        return jax.lax.cond(carry.pending != NONE, functools.partial(self._window, carry, lo, True),
                            functools.partial(self._window, carry, lo, False))

    def _window(self, carry: Carry, lo, folded: bool) -> tuple[Carry, Pass]:
        b, r = self.spec.block_length, self.spec.read_width
        lead = b if folded else 0
        drafted = jnp.minimum(self.spec.lookahead, (self.length - lo) // b - 1)
        rows = b * (1 + drafted)
        slot = jnp.arange(lead + r)
        out = self.forward(carry, lo - lead, lead + r, slot < lead + rows, (slot // b)[None])
        if folded:
            carry = self.commit_kv(carry, out, lo - lead)._replace(pending=jnp.int32(NONE))
        unbiased = jnp.zeros(self.config.embedding_size, jnp.float32)
        read = read_out(self.params, head_rows(out.hidden, lead + jnp.arange(r)), jnp.float32(0.0), unbiased,
                        unbiased, ARGMAX, self.layout_rule)
        logp = read.logp[0]
        bad = first_nonfinite(jnp, logp[None], jnp.arange(r) < rows, lo + jnp.arange(r), NOT_COMMITTED)
        return carry, Pass(read.x0[0], logp, (lead + rows).astype(jnp.int32), rows.astype(jnp.int32),
                           bad.astype(jnp.int32))

    def commit(self, carry: Carry, block, lo, out: Pass, committed, edited, old) -> Carry:
        """Write the block's `committed` rows, its `edited` ones and the confident drafts; record the pass."""
        b, r = self.spec.block_length, self.spec.read_width
        window = jax.lax.dynamic_slice(carry.tokens, (lo,), (r,))
        ahead = (jnp.arange(r) >= b) & (jnp.arange(r) < out.rows)
        drafts = draft_commits(ahead, window == self.config.mask_token_id, out.logp >= self.inputs.draft_cutoff)
        written = jnp.concatenate([committed, jnp.zeros(r - b, bool)]) | drafts
        replaced = written | jnp.concatenate([edited, jnp.zeros(r - b, bool)])
        failed = out.bad_position != NOT_COMMITTED
        tokens = jax.lax.dynamic_update_slice(carry.tokens, jnp.where(replaced & ~failed, out.x0, window), (lo,))
        values = (block, out.width, out.rows, written, out.x0, out.logp, edited, old)
        records = Records._make(
            jax.lax.dynamic_update_index_in_dim(record, jnp.asarray(value, record.dtype), carry.nfe, 0)
            for record, value in zip(carry.records, values))
        return carry._replace(tokens=tokens, nfe=carry.nfe + 1, records=records,
                              bad=jnp.where(failed, jnp.stack([carry.nfe, out.bad_position]), carry.bad))

    def masks(self, tokens):
        return tokens == self.config.mask_token_id

    def mask_commits(self, out: Pass, active, share):
        """The block's masks a pass commits: all above the threshold if `share` are, else the `share` best."""
        head = out.logp[: self.spec.block_length]
        return share_commits(jnp, ranks(jnp, head, active), active, head >= self.inputs.commit_cutoff, share)

    def schedule_block(self, carry: Carry, block, denoised) -> Carry:
        """LLaDA2.0: the block's steps, each committing above threshold or its share of the most confident
        (none unless `denoised`: a prompt block is only cached)."""
        lo = block * self.spec.block_length
        shares = jnp.asarray(self.spec.shares, jnp.int32)

        def going(state):
            step, carry = state
            active = self.masks(self.block_tokens(carry, lo))
            return denoised & (step < len(self.spec.shares)) & jnp.any(active) & (carry.bad[0] == NOT_COMMITTED)

        def one_step(state):
            step, carry = state
            old = self.block_tokens(carry, lo)
            active = self.masks(old)
            carry, out = self.predict(carry, lo)
            committed = self.mask_commits(out, active, shares[step])
            return step + 1, self.commit(carry, block, lo, out, committed, jnp.zeros_like(active), old)

        return jax.lax.while_loop(going, one_step, (jnp.int32(0), carry))[1]

    def edit_block(self, carry: Carry, block, denoised) -> Carry:
        """LLaDA2.1: commits and edits until a pass without masks edits nothing, or max_post_steps such passes;
        a block whose tokens and post-step count repeat (the reference would loop forever), or that runs
        `passes_per_block` passes, is bounded (none unless `denoised`). Each pass decides whether the next one
        stops the block, so no branch holds the forward and the loop's test computes nothing: a streamed
        bundle's loop then compiles."""
        b, bound = self.spec.block_length, self.spec.passes_per_block
        lo = block * b

        def going(passes, done, carry):
            return denoised & ~done & (passes < bound) & (carry.bad[0] == NOT_COMMITTED)

        def before_pass(passes, post_steps, done, seen_tokens, seen_post, carry):
            """The next pass's post-step count; the block done if that pass stops it, bounded if it repeats."""
            old = self.block_tokens(carry, lo)
            post_steps = post_steps + ~jnp.any(self.masks(old))
            seen = jnp.any(jnp.all(seen_tokens == old, axis=1) & (seen_post == post_steps)
                           & (jnp.arange(bound) < passes))
            over = post_steps > self.spec.max_post_steps
            stop = going(passes, done, carry) & (over | seen)
            return (passes, post_steps, done | stop, seen_tokens, seen_post,
                    carry._replace(bounded=carry.bounded + (stop & seen & ~over)))

        def one_pass(state):
            passes, post_steps, was_done, seen_tokens, seen_post, carry = state
            old = self.block_tokens(carry, lo)
            active = self.masks(old)
            carry, out = self.predict(carry, lo)
            committed = self.mask_commits(out, active, self.spec.num_to_transfer)
            answer = lo + jnp.arange(b) >= self.inputs.prompt_len  # here, not captured: see iree-limits.md
            edited = ~active & answer & (out.logp[:b] >= self.inputs.edit_cutoff) & (out.x0[:b] != old)
            carry = self.commit(carry, block, lo, out, committed, edited, old)
            # `was_done` is False here; read, it keeps the loop's flag an argument of the loop's test, which IREE
            # 3.13 needs (with it unread, the rotated loop's two regions disagree and iree-compile crashes)
            done = ~jnp.any(active) & ~jnp.any(edited) | was_done
            return before_pass(passes + 1, post_steps, done, seen_tokens.at[passes].set(old),
                               seen_post.at[passes].set(post_steps), carry)

        history = (jnp.zeros((bound, b), jnp.int32), jnp.zeros(bound, jnp.int32))
        state = before_pass(jnp.int32(0), jnp.int32(0), jnp.bool_(False), *history, carry)
        passes, _, done, _, _, carry = jax.lax.while_loop(lambda state: going(state[0], state[2], state[5]),
                                                          one_pass, state)
        return carry._replace(bounded=carry.bounded + (denoised & ~done & (passes >= bound)))
