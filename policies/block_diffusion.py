"""Block diffusion (LLaDA2.0, LLaDA2.1): the canvas is cut into blocks from position 0 and attention is
block-causal, so a finished block's K/V never change and a cache of them is exact.

The canvas is the prompt plus the answer rounded up to whole blocks; the block holding the prompt's end is
denoised with the answer (its prompt positions stay). With the cache (every policy but `vanilla`), the
prompt's whole blocks are computed once, block by block, each against the ones before it; every step then
computes only the current block against the cached blocks, and a finished block's K/V are computed once
from its final tokens. Where the backend masks inside a window (`Backend.block_windows`: XLA) that computation
is folded into the next block's first pass, whose window leads with the finished block (block-causal, its rows
not read out); elsewhere (bundles), and for a block no pass follows into, it is a pass of its own, counted in
`stats["cache_passes"]`, not in `nfe`. `vanilla` is the uncached twin: each step recomputes every earlier
block from scratch first, as the reference recomputes its window.

Commit rules, as the reference samplers (dllm `LLaDA2Sampler`, `LLaDA21Sampler`) at temperature 0:
- 2.0 (`editing_threshold` None): `steps` per block (at most gen_length // minimal_topk), the block's
  positions split evenly over them; each step commits every masked position with probability > threshold,
  or, when fewer than the step's share are, the share's most confident.
- 2.1 (`editing_threshold` set): each step commits the masked positions above threshold, or the
  `num_to_transfer` most confident; and replaces a committed answer token of the block whose new prediction
  differs with probability > editing_threshold. Once the block has no mask, up to `max_post_steps` more
  passes edit it; the block ends at a pass that edits nothing. The reference can loop forever (a mask
  predicted as itself every time, edits that cycle); here a block whose state repeats, or that runs past
  `pass_bound`, stops (`stats["bounded_blocks"]` counts them).

Speculation (`lookahead` > 0): each pass's window also holds the following `lookahead` blocks, block-causal
inside it (a position sees its own block and earlier ones), so the current block's predictions are the
unspeculated ones; masked positions of those blocks predicted at `draft_threshold` or above are committed early.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import numpy as np

from llada_jax.model.readout import check_finite
from llada_jax.system.errors import LladaError
from policies.backend import BackendCall
from policies.canvas import Canvas
from policies.decisions import ranks, share_commits
from policies.loop import Result, StepRecord
from policies.sampling import Sampler

REFERENCE_THRESHOLD = 0.95  # the reference samplers' default commit threshold
BLOCK_POLICY = "dual-cache"  # the default decoder on block-diffusion models: the exact block cache


def family_decoder(block_causal: bool, policy: str | None, threshold: float | None) -> tuple[str | None, float | None]:
    """(policy, threshold) of a run that names no policy: on block-diffusion models the exact block cache at the
    reference samplers' threshold; otherwise as given (None: the caller's own default)."""
    if policy is None and block_causal:
        return BLOCK_POLICY, REFERENCE_THRESHOLD if threshold is None else threshold
    return policy, threshold


@dataclasses.dataclass(frozen=True)
class BlockSettings:
    """One block-diffusion generation's settings (the reference samplers' arguments; see the module doc)."""

    gen_length: int
    block_length: int
    steps: int                          # per block (2.0)
    threshold: float | None             # None: the schedule alone (the reference's threshold >= 1)
    cached: bool = True
    minimal_topk: int = 1
    editing_threshold: float | None = None  # set: LLaDA2.1's decoder
    max_post_steps: int = 16
    num_to_transfer: int = 1
    lookahead: int = 0                  # following blocks drafted in each step's window (+speculative)
    draft_threshold: float = 0.9        # a draft is committed at this confidence or above

    def __post_init__(self):
        for name in ("gen_length", "block_length", "steps", "minimal_topk", "num_to_transfer"):
            if getattr(self, name) < 1:
                raise LladaError(f"{name} must be >= 1, got {getattr(self, name)}"
                                 + (" (the reference loops forever at 0)" if name == "num_to_transfer" else ""))
        if self.max_post_steps < 0:
            raise LladaError(f"max_post_steps must be >= 0, got {self.max_post_steps}")
        for name in ("threshold", "editing_threshold"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise LladaError(f"{name} must be a finite number, got {value}")
        if self.editing_threshold is None and self.gen_length < self.minimal_topk:
            raise LladaError(f"gen_length // minimal_topk = {self.gen_length} // {self.minimal_topk} leaves no step "
                             "per block; lower minimal_topk")

    def canvas_length(self, prompt_length: int) -> int:
        """The prompt plus the answer, rounded up to whole blocks."""
        return -(-(prompt_length + self.gen_length) // self.block_length) * self.block_length

    @property
    def block_steps(self) -> int:
        """2.0's denoising steps per block."""
        return min(self.steps, self.gen_length // self.minimal_topk)

    def shares(self) -> np.ndarray:
        """2.0's positions to commit at each step of a block: the block split evenly, the remainder first."""
        steps = self.block_steps
        if steps == 0:
            return np.zeros(0, np.int64)
        counts = np.full(steps, self.block_length // steps, np.int64)
        counts[: self.block_length % steps] += 1
        return counts


def mask_commits(confidence: np.ndarray, active: np.ndarray, threshold: float | None, share: int) -> np.ndarray:
    """[W] bool: the masked positions a step commits: all above threshold if at least `share` are, else the
    `share` most confident (ties to the lower position)."""
    confident = confidence > threshold if threshold is not None else np.zeros_like(active)
    return share_commits(np, ranks(np, confidence, active), active, confident, share)


def block_call(kv, tokens: np.ndarray, lo: int, width: int, length: int | None = None, reads=None,
               block_length: int | None = None) -> BackendCall:
    """The window step of [lo, lo + width) of `tokens` `[B, S]` against the cached blocks before `lo`;
    positions at or past `length` are padding. With `block_length` below `width`, the window holds several
    blocks, each seeing itself and the ones before it (block-causal)."""
    rows, slots = tokens.shape
    columns = np.arange(lo, lo + width)
    visible = np.broadcast_to(np.arange(slots) < lo, tokens.shape)
    positions = np.broadcast_to(columns, (rows, width))
    valid = np.broadcast_to(columns < (slots if length is None else length), positions.shape)
    blocks = None
    if block_length is not None and block_length < width:
        blocks = np.broadcast_to(np.arange(width, dtype=np.int32) // block_length, positions.shape)
    return BackendCall("window", (kv, visible, tokens[:, columns], positions, valid, reads), blocks)


def commit_block(kv, tokens: np.ndarray, lo: int, width: int, out, nfe: int, length: int | None = None,
                 kept: int | None = None) -> BackendCall:
    """The commit of `out`'s K/V for the window at `lo` (its real positions; with `kept`, its first `kept` only),
    computed from `tokens`' window."""
    rows, slots = tokens.shape
    columns = np.arange(lo, lo + width)
    positions = np.broadcast_to(columns, (rows, width))
    end = min(slots if length is None else length, lo + (width if kept is None else kept))
    write = np.broadcast_to(columns < end, positions.shape)
    return BackendCall("commit", (kv, positions, write, out, tokens[:, columns], nfe))


@dataclasses.dataclass
class BlockRun:
    """One generation's canvas, cache and counters while its blocks run."""

    canvas: Canvas
    settings: BlockSettings
    sampler: Sampler
    rng: np.random.Generator
    fresh_state: Callable  # () -> an empty KV state of the canvas's shape
    kv: object = None
    fold: bool = False          # a finished block's K/V come from the next pass (`Backend.block_windows`)
    pending: int | None = None  # the finished block whose K/V the next pass computes, folded
    computed: int = 0           # positions the last denoising pass computed
    trace: list = dataclasses.field(default_factory=list)
    cache_passes: int = 0
    bounded_blocks: int = 0

    def cache_block(self, lo: int):
        """Compute the block at `lo` from its tokens now and commit its K/V (a generator of the two calls)."""
        width = self.settings.block_length
        out = yield block_call(self.kv, self.canvas.tokens, lo, width, reads=(0,))
        self.kv = yield commit_block(self.kv, self.canvas.tokens, lo, width, out, len(self.trace))
        self.cache_passes += 1

    def finished(self, lo: int):
        """The block at `lo` is final: its K/V are cached now, or, folding, by the next denoising pass (a
        generator; a block the last pass left uncached is cached first)."""
        yield from self.flush()
        if self.fold:
            self.pending = lo
        else:
            yield from self.cache_block(lo)

    def flush(self):
        """Cache the pending finished block in a pass of its own (no denoising pass took it)."""
        if self.pending is not None:
            lo, self.pending = self.pending, None
            yield from self.cache_block(lo)

    def predict(self, lo: int):
        """One denoising pass over the block at `lo` and the following blocks it drafts: (x0, confidence) per
        position of the window (a generator)."""
        if not self.settings.cached:  # the uncached twin: every earlier block recomputed first
            self.kv = self.fresh_state()
            for earlier in range(0, lo, self.settings.block_length):
                yield from self.cache_block(earlier)
        block_length = self.settings.block_length
        drafted = min(self.settings.lookahead, (self.canvas.length - lo) // block_length - 1)
        width = block_length * (1 + drafted)
        start = lo if self.pending is None else self.pending  # folded: the finished block leads the window
        reads = None if start == lo else tuple(range(lo - start, lo - start + width))
        self.computed = lo - start + width
        out = yield block_call(self.kv, self.canvas.tokens, start, self.computed, reads=reads,
                               block_length=block_length)
        if start != lo:
            self.kv = yield commit_block(self.kv, self.canvas.tokens, start, lo - start + width, out,
                                         len(self.trace), kept=lo - start)
            self.pending = None
        check_finite(out.readout, np.arange(lo, lo + width), np.ones(width, bool), len(self.trace))
        x0, confidence, _ = self.sampler.choose(out.readout, self.rng)
        return x0, confidence

    def commit(self, lo: int, committed: np.ndarray, x0: np.ndarray, confidence: np.ndarray) -> np.ndarray:
        """Write the block's `committed` positions, and the drafts: the masked positions of the following blocks
        in the window predicted at `draft_threshold` or above. Returns every position written, `[window]`."""
        tokens, width = self.canvas.tokens, self.settings.block_length
        ahead = tokens[0, lo + width: lo + len(x0)] == self.canvas.mask_id
        drafts = ahead & (confidence[width:] >= self.settings.draft_threshold)
        written = np.concatenate([committed, drafts])
        tokens[:, lo + np.flatnonzero(written)] = x0[written]
        return written

    def record(self, block: int, lo: int, committed: np.ndarray, x0, confidence, revisions=()) -> None:
        positions = lo + np.flatnonzero(committed)
        self.trace.append(StepRecord(
            nfe=len(self.trace), block=block, kind="window", width=self.computed, shape_width=self.computed,
            useful=len(committed),
            positions=tuple(int(p) for p in positions), tokens=tuple(int(t) for t in x0[committed]),
            confidence=tuple(float(c) for c in confidence[committed]),
            drafts=int(committed[self.settings.block_length:].sum()), revisions=tuple(revisions)))


def decode_blocks(backend, prompt_ids: np.ndarray, settings: BlockSettings, sampler: Sampler, *, mask_id: int,
                  max_len: int, seed: int = 0, offset: int = 0, on_step: Callable | None = None):
    """Generate after `prompt_ids` block by block (a generator of step calls, like `policies.loop.decode_steps`).
    A batch's rows keep their own blocks: `offset` (left padding) is not applied."""
    del offset  # blocks start at the row's position 0, as the reference's; rows need no common columns
    started = time.perf_counter()
    length = settings.canvas_length(len(prompt_ids))
    canvas = Canvas.start(prompt_ids, length - len(prompt_ids), mask_id, False, max_len)
    def fresh_state():
        return backend.empty_state(canvas.tokens.shape[0], canvas.padded_length)

    run = BlockRun(canvas, settings, sampler, np.random.default_rng(seed), fresh_state, fresh_state(),
                   fold=settings.cached and backend.block_windows())
    width, prompt_len = settings.block_length, len(prompt_ids)
    if settings.cached:
        for lo in range(0, prompt_len // width * width, width):
            yield from run.finished(lo)
    last = length // width - 1
    for block in range(prompt_len // width, last + 1):
        lo = block * width
        denoise = edit_block if settings.editing_threshold is not None else schedule_block
        yield from denoise(run, block, lo, on_step)
        if settings.cached and block < last:
            yield from run.finished(lo)
    output = canvas.tokens[0, prompt_len: prompt_len + settings.gen_length].astype(np.int64)
    stats = {"cache_passes": run.cache_passes, "canvas_length": length}
    if settings.editing_threshold is not None:
        stats["bounded_blocks"] = run.bounded_blocks
    return Result(output, len(run.trace), time.perf_counter() - started, tuple(run.trace), prompt_len, stats)


def schedule_block(run: BlockRun, block: int, lo: int, on_step):
    """LLaDA2.0: the block's steps, each committing above threshold or its share of the most confident."""
    tokens = run.canvas.tokens
    for share in run.settings.shares():
        active = tokens[0, lo: lo + run.settings.block_length] == run.canvas.mask_id
        if not active.any():
            return
        x0, confidence = yield from run.predict(lo)
        width = run.settings.block_length
        committed = mask_commits(confidence[:width], active, run.settings.threshold, int(share))
        run.record(block, lo, run.commit(lo, committed, x0, confidence), x0, confidence)
        if on_step is not None:
            on_step(run.canvas, run.trace[-1])


def edit_block(run: BlockRun, block: int, lo: int, on_step):
    """LLaDA2.1: commits and edits until a pass without masks edits nothing (or max_post_steps such passes).
    At temperature 0 a pass is a function of the block's tokens and the post-step count, so a state seen
    before means the reference would loop forever: the block stops there (`bounded_blocks`); sampling, the
    block stops after `pass_bound` passes."""
    settings, tokens = run.settings, run.canvas.tokens
    answer = np.arange(lo, lo + settings.block_length) >= run.canvas.prompt_len
    post_steps, seen = 0, set()
    for _ in range(pass_bound(settings)):
        old = tokens[0, lo: lo + settings.block_length].copy()
        active = old == run.canvas.mask_id
        post_steps += not active.any()
        if post_steps > settings.max_post_steps:
            return
        if run.sampler.temperature == 0.0:
            state = (old.tobytes(), post_steps)
            if state in seen:
                break
            seen.add(state)
        x0, confidence = yield from run.predict(lo)
        width = settings.block_length
        committed = (mask_commits(confidence[:width], active, settings.threshold, settings.num_to_transfer)
                     if active.any() else np.zeros_like(active))
        edited = ~active & answer & (confidence[:width] > settings.editing_threshold) & (x0[:width] != old)
        tokens[:, lo + np.flatnonzero(edited)] = x0[:width][edited]
        run.record(block, lo, run.commit(lo, committed, x0, confidence), x0, confidence,
                   [(lo + int(i), int(old[i]), int(x0[i])) for i in np.flatnonzero(edited)])
        if on_step is not None:
            on_step(run.canvas, run.trace[-1])
        if not active.any() and not edited.any():
            return
    run.bounded_blocks += 1


def pass_bound(settings: BlockSettings) -> int:
    """The most passes a 2.1 block takes: generous, as a mask predicted as itself or an edit undone later
    still let the reference end; only a loop it never leaves reaches this."""
    return 16 * (settings.block_length + settings.max_post_steps + 1)


def block_logits(backend, ids: np.ndarray, block_length: int, mask_id: int, slots: int,
                 context_ids: np.ndarray | None = None) -> np.ndarray:
    """Float32 logits `[B, L]` of `ids` under block-causal attention: block by block, each against the cached
    K/V of the blocks before it (what the reference's full window under its block mask computes). With
    `context_ids` `[B, L]`, the earlier blocks are those of `context_ids` instead (a noised sequence read against
    its clean one, as block diffusion's training bound attends: [x_t ⊕ x_0])."""
    batch, length = ids.shape
    padded, context = (np.full((batch, slots), mask_id, np.int32) for _ in range(2))
    padded[:, :length] = ids
    context[:, :length] = ids if context_ids is None else context_ids
    kv = backend.empty_state(batch, slots)
    pieces = []
    for lo in range(0, length, block_length):
        out = block_call(kv, padded, lo, block_length, length).run(backend)
        pieces.append(np.asarray(out.readout.logits, np.float32))
        if lo + block_length < length:
            if context_ids is not None:
                out = block_call(kv, context, lo, block_length, length, reads=(0,)).run(backend)
            kv = commit_block(kv, context, lo, block_length, out, 0, length).run(backend)
    return np.concatenate(pieces, axis=1)[:, :length]
