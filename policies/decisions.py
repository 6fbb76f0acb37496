"""The decisions a decoding step makes, written once for both loops: the host loop (`policies.loop`) calls
them with numpy on one block's positions, the compiled loop (`policies.decode_loop`) with jax.numpy on the
whole canvas, as fixed-width masks. `xp` is the array namespace.

Confidence comparisons come in as masks (`confident`): each loop compares in its own domain, the host loop a
probability against the threshold, the compiled loop a float32 log-probability against the threshold's log.
"""

from __future__ import annotations

from llada_jax.model.shapes import bucket


def ranks(xp, order, candidates):
    """`[N]` each position's rank among `candidates` by `order`, highest first (0: the first to commit): how
    many candidates have a higher key, or an equal one at a lower position. Non-candidates get a rank too;
    callers mask them. All pairs, O(N^2) over a block or canvas: ranks by stable sorts gave other tokens in IREE
    3.13's compiled loop (`docs/iree-limits.md`)."""
    positions = xp.arange(order.shape[0])
    earlier = positions[None, :] < positions[:, None]
    higher = (order[None, :] > order[:, None]) | ((order[None, :] == order[:, None]) & earlier)
    return xp.sum(candidates[None, :] & higher, axis=1)


def scheduled_count(masked_at_start, steps_per_block: int, step):
    """Tokens LLaDA's fixed schedule commits at `step` of a block that began with `masked_at_start` masks:
    an even split over the block's steps, the first `masked_at_start % steps_per_block` steps one more."""
    return masked_at_start // steps_per_block + (step < masked_at_start % steps_per_block)


def fixed_commits(rank, candidates, count):
    """LLaDA's fixed schedule: the `count` first-ranked candidates."""
    return candidates & (rank < count)


def threshold_commits(rank, candidates, confident):
    """Fast-dLLM's threshold rule: every confident candidate, and always the first-ranked one."""
    return candidates & (confident | (rank == 0))


def share_commits(xp, rank, candidates, confident, share):
    """Block diffusion's rule (LLaDA2): every confident candidate if at least `share` are, else the `share`
    first-ranked (all of them when fewer)."""
    high = candidates & confident
    return xp.where(xp.sum(high) >= share, high, candidates & (rank < share))


def draft_commits(drafts, masked, confident):
    """Speculation: the still-masked positions of the draft region the model is already sure of."""
    return drafts & masked & confident


def read_rows(xp, in_reads, masked):
    """The rows whose predictions a step reads out (the LM head runs on those alone): the masks among
    `in_reads` (the rules commit masks only), or the first of `in_reads` when none is left (a fixed schedule's
    idle step still reads one)."""
    wanted = in_reads & masked
    return xp.where(xp.any(wanted), wanted, xp.arange(in_reads.shape[0]) == xp.argmax(in_reads))


def block_going(any_masked, step, steps_per_block: int, stops_when_filled: bool, block_length: int):
    """Whether a block takes another step: until it has no mask left (cached decoders, speculation and the
    threshold rule, as Fast-dLLM), or exactly its scheduled steps (vanilla's fixed schedule, as LLaDA). Never
    more than max(steps_per_block, block_length) steps: every rule fills a block within them, unless the model
    predicts the mask token itself (the reference loops then never end; here the block ends with it)."""
    going = any_masked if stops_when_filled else step < steps_per_block
    return going & (step < max(steps_per_block, block_length))


def speculative_width(block_length: int, asked: int, slots: int) -> int:
    """Slots of a block-only window widened to hold drafts too: `asked`, else twice the block, as a shape bucket;
    never wider than the canvas (a block over half of it leaves fewer positions to draft than a block)."""
    return bucket(min(asked or 2 * block_length, slots), slots)


def drafts_taken(xp, drafting, room):
    """The first `room` positions of the mask `drafting` (position order): the drafts a widened window holds."""
    return drafting & (xp.cumsum(drafting) - 1 < room)


def speculative_window(xp, block_start, block_length: int, drafting, width: int):
    """A block-only window widened to `width` slots with drafts: `[W]` canvas positions and their validity, the
    block's positions first, then the first drafts of the mask `drafting` `[S]` that fit, in position order."""
    slot = xp.arange(width)
    taken = drafts_taken(xp, drafting, width - block_length)
    placed = xp.where(taken, block_length + xp.cumsum(drafting) - 1, width)[None, :] == slot[:, None]  # [W, S]
    drafted = xp.sum(placed * xp.arange(drafting.shape[0]), axis=1)
    return xp.where(slot < block_length, block_start + slot, drafted), slot < block_length + xp.sum(taken)
