"""Dual-path progressive revision: committed tokens stay revisable until confirmed, and the K/V of
tokens that changed is refreshed on a side path instead of by full-canvas forwards.

Dense path: one full prefill, then only the base policy's window steps (dual-cache, prefix-cache, or
speculative over either), each led by the *carry*: the slots of the block just finished whose K/V is
stale (its last commits, or a revision). They are the next block's nearest context, so the dense step
recomputes them exactly in its window instead of waiting for the side path. Every dense step's window
K/V is committed to the KV state.

Side path: after step t's commits, a job is submitted with a snapshot of the canvas and KV state. It
(1) recomputes the K/V of every committed slot whose cached K/V came from another token
(`slot_token != canvas`: just committed, drafted, or revised); (2) re-scores each unstable committed
token of step t's window the way LLaDA predicts, with that token masked and everything else visible.
Every side step is `side_width` slots wide (a fixed shape): stale slots are refreshed in chunks,
later chunks seeing earlier ones refreshed; tokens to re-score are split into interleaved groups, so
each keeps most neighbours visible. The job runs while dense step t+1 computes (on the host with XLA
under an IREE GPU dense path; inline, just before it, otherwise) and is merged right after that dense
step: refreshed K/V go into slots that are still stale, and re-scores confirm or revise tokens. Invariant: a
dense step attends to a stale slot only if it went stale after the previous dense step (a draft or revision
then sees its previous K/V for one step); the merge makes it current before the next dense step.

Revision: if the re-score's argmax agrees, that is a confirmation; after `confirmations` of them, or
when committed at confidence >= `stable_confidence`, the token is *stable*: final, and so is its K/V.
If the argmax disagrees at confidence >= `revise_threshold` and above the confidence the current token
had when it was committed, the token is revised: replaced by the new argmax. (Replaced, not re-masked:
a mask left in a finished block would never be decoded again.)
The job of the last dense step is merged when the generation ends. A revision changes its neighbours'
context, so the generation then *settles*: while the last merge revised something, another side job
re-scores every unstable token of the answer, up to `settle_rounds` times (no dense step is left to
hide these behind; on the embedded model they lift accuracy at aggressive thresholds, see README).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, NamedTuple

import numpy as np

from llada_jax.model import kv_state
from llada_jax.model.readout import check_finite
from llada_jax.model.shapes import bucket
from llada_jax.system.errors import LladaError
from policies.cache_policies import DualCache, PrefixCache
from policies.canvas import Block, Canvas, Window
from policies.canvas_steps import canvas_wide, commit_window, window_step
from policies.policy import Policy, Revisions, StepPlan, write_revisions
from policies.side_path import SidePath, side_path_for

NEVER = -1


@dataclasses.dataclass(frozen=True)
class Revision:
    base: Policy = DualCache()
    revise_threshold: float = 0.5
    confirmations: int = 2
    stable_confidence: float = 0.99
    side_width: int = 8
    settle_rounds: int = 2        # re-scoring rounds after the last dense step while revisions continue

    @property
    def stops_when_filled(self) -> bool:
        return True

    def __post_init__(self):
        chain = _chain(self.base)
        if any(isinstance(p, Revision) for p in chain) or not isinstance(chain[-1], (DualCache, PrefixCache)):
            raise LladaError("revision needs a cached base policy (prefix-cache or dual-cache)")
        if not 0.0 < self.revise_threshold <= 1.0 or not 0.0 < self.stable_confidence <= 1.0:
            raise LladaError("revision thresholds must be in (0, 1]")
        if self.confirmations < 1 or self.side_width < 1:
            raise LladaError("revision confirmations and probe width must be >= 1")
        if self.settle_rounds < 0:
            raise LladaError(f"revision settle rounds must be >= 0, got {self.settle_rounds}")

    def plan(self, canvas: Canvas, block: Block, step: int, kv: kv_state.KVState | None) -> StepPlan:
        """One full prefill, then the base policy's window steps (never its block-start full step: the
        base is asked for a later step's plan) led by the carry. Every dense step's K/V is committed."""
        base = self.base.plan(canvas, block, max(step, 1), kv)
        everything = np.ones(canvas.padded_length, bool)
        if kv is None or not kv.filled.any():
            return dataclasses.replace(base, positions=None, width=None, keep_kv=everything, reads=None)
        positions, width = _with_carry(canvas, kv, block, base)
        return dataclasses.replace(base, positions=positions, width=width, keep_kv=everything, reads=None)

    @contextlib.contextmanager
    def side_path(self, backend, canvas: Canvas) -> Iterator["RevisionSession"]:
        """The side path of one generation; its worker thread is shut down however the generation ends."""
        side = side_path_for(backend)
        try:
            yield RevisionSession(self, backend, canvas, side)
        finally:
            side.close()


def _chain(policy) -> list:
    """The policy and the ones it widens, outermost first."""
    chain = [policy]
    while hasattr(chain[-1], "base"):
        chain.append(chain[-1].base)
    return chain


def _with_carry(canvas: Canvas, kv: kv_state.KVState, block: Block, base: StepPlan):
    """(positions, width): the carry (stale committed slots of the previous block), then the base plan's
    window; speculative drafts give way to the carry when the width is fixed."""
    length = block.end - block.start
    start = max(canvas.prompt_len, block.start - length)
    stale = kv_state.stale_slots(kv, canvas.tokens)[0] & ~canvas.masked
    carry = start + np.flatnonzero(stale[start: block.start])
    assert base.positions is not None, "revision widens a window step"
    positions = np.concatenate([carry, base.positions])
    if base.width is None:
        return positions, None
    keep = len(carry) + length
    return positions[: max(base.width, keep)], max(base.width, bucket(keep, canvas.padded_length))


class SideResult(NamedTuple):
    """What a side job found, against the snapshot it was given."""

    refreshed: tuple              # (window, [B, W] tokens, StepOutput) per refresh step
    probed: np.ndarray            # positions re-scored
    probed_tokens: np.ndarray     # the tokens they held
    x0: np.ndarray                # the model's choice at each, with it masked
    confidence: np.ndarray


class RevisionSession:
    """The reviser of one generation: per-position revision state and the side job in flight.

    Per canvas position: `stable` (final tokens), `confirmations` (agreeing re-scorings since commit or
    revision), `committed_at` (dense step of the last commit/revision, NEVER while masked) and `belief`
    (confidence of the current token when committed or revised to)."""

    def __init__(self, policy: Revision, backend, canvas: Canvas, side: SidePath):
        self.policy, self.backend, self.canvas, self.side = policy, backend, canvas, side
        length = canvas.padded_length
        self.stable = np.zeros(length, bool)
        self.confirmations = np.zeros(length, np.int64)
        self.committed_at = np.full(length, NEVER, np.int64)
        self.belief = np.zeros(length)
        self.pending = None        # Future[SideResult] of the job submitted after the last dense step
        self.refreshes = 0         # slots recomputed by the side path
        self.probes = 0            # tokens re-scored by the side path
        self.last_nfe = 0          # the last dense step

    def merge(self, kv: kv_state.KVState, nfe: int,
              rows: np.ndarray | None = None) -> tuple[kv_state.KVState, Revisions]:
        """Apply the pending side job: its K/V where the slot is still stale, then its re-scores, returned as
        revisions for the caller to write. `rows`: the canvas's token rows as they stand (default: the canvas's)."""
        if self.pending is None:
            return kv, ()
        found: SideResult = self.side.join(self.pending)
        self.pending = None
        tokens_now = self.canvas.tokens if rows is None else rows
        for window, tokens, out in found.refreshed:
            still = (kv.slot_token[:, window.positions] != tokens) & (tokens_now[:, window.positions] == tokens)
            kv = commit_window(self.backend, kv, window, still.all(axis=0), self.side.to_dense(out), tokens, nfe)
        self.refreshes += sum(int(window.valid.sum()) for window, _, _ in found.refreshed)
        self.probes += len(found.probed)
        return kv, self._rescore(found, nfe, tokens_now)

    def submit(self, kv: kv_state.KVState, window: Window, confidence: np.ndarray, nfe: int) -> None:
        """Record the step's new commits, then hand the side path its job over a snapshot: refresh stale
        slots, re-score the window's unstable tokens."""
        self._mark_new_commits(confidence, nfe)
        self._submit_job(kv, window, nfe)

    def _submit_job(self, kv: kv_state.KVState, window: Window, nfe: int, rows: np.ndarray | None = None) -> None:
        computed = window.positions[window.valid]
        unstable = computed[~self.stable[computed] & (self.committed_at[computed] != NEVER)]
        snapshot = dataclasses.replace(self.canvas, tokens=(self.canvas.tokens if rows is None else rows).copy())
        self.pending = self.side.submit(_side_job, kv, snapshot, np.sort(unstable), self.policy.side_width, nfe)
        self.last_nfe = nfe

    def finish(self, kv: kv_state.KVState) -> tuple[kv_state.KVState, Revisions]:
        """Merge the last job, then settle: re-score the answer's unstable tokens again while the
        previous merge revised any (up to `settle_rounds`), each round over the canvas with the revisions so far.
        Returns every revision made here, for the caller to write."""
        rows = self.canvas.tokens.copy()
        kv, merged = self.merge(kv, self.last_nfe, rows)
        revisions = list(merged)
        answer = self.canvas.window(np.arange(self.canvas.prompt_len, self.canvas.length))
        for _ in range(self.policy.settle_rounds):
            if not merged:
                break
            write_revisions(rows, merged)
            self._submit_job(kv, answer, self.last_nfe, rows)
            kv, merged = self.merge(kv, self.last_nfe, rows)
            revisions += merged
        return kv, tuple(revisions)

    def stats(self) -> dict:
        return {"refreshes": self.refreshes, "probes": self.probes, **self.side.stats()}

    def _mark_new_commits(self, confidence: np.ndarray, nfe: int) -> None:
        """Record this step's new commits; very confident ones are stable at once."""
        canvas = self.canvas
        new = (self.committed_at == NEVER) & ~canvas.masked
        new[: canvas.prompt_len] = False
        new[canvas.length:] = False
        self.committed_at = np.where(new, nfe, self.committed_at)
        self.stable = self.stable | (new & (confidence >= self.policy.stable_confidence))
        self.belief = np.where(new, confidence, self.belief)

    def _rescore(self, found: SideResult, nfe: int, rows: np.ndarray) -> Revisions:
        """Confirm the tokens the re-score agrees with; revise those it rejects confidently enough (the probed
        positions are distinct, so each check reads the canvas `rows` before any revision of this re-score)."""
        policy = self.policy
        revisions = []
        for p, token, choice, confidence in zip(found.probed, found.probed_tokens, found.x0, found.confidence):
            if self.stable[p] or rows[0, p] != token:
                continue
            if choice == token:
                self.confirmations[p] += 1
                self.stable[p] = self.confirmations[p] >= policy.confirmations
            elif confidence >= policy.revise_threshold and confidence > self.belief[p]:
                revisions.append((int(p), int(token), int(choice)))
                self.confirmations[p] = 0
                self.committed_at[p] = nfe
                self.belief[p] = confidence
        return tuple(revisions)


def _side_job(side_backend, kv: kv_state.KVState, canvas: Canvas, to_probe: np.ndarray, side_width: int,
              nfe: int) -> SideResult:
    """Refresh every stale committed slot, then re-score `to_probe` against the refreshed cache."""
    width = bucket(min(side_width, canvas.padded_length), canvas.padded_length)  # a declared shape
    stale = np.flatnonzero(kv_state.stale_slots(kv, canvas.tokens)[0] & ~canvas.masked)
    refreshed = []
    for start in range(0, stale.size, width):  # later chunks see earlier ones refreshed
        window = canvas.window(stale[start: start + width], width)
        tokens = canvas.tokens[:, window.positions].copy()
        out = window_step(side_backend, canvas, kv, window)
        kv = commit_window(side_backend, kv, window, window.valid, out, tokens, nfe)
        refreshed.append((window, tokens, out))
    x0 = np.zeros(to_probe.size, np.int64)
    confidence = np.zeros(to_probe.size)
    groups = max(min(2, to_probe.size), -(-to_probe.size // width))
    for group in range(groups):
        chosen = np.arange(group, to_probe.size, groups)
        x0[chosen], confidence[chosen] = _probe(side_backend, canvas, kv, to_probe[chosen], width, nfe)
    return SideResult(tuple(refreshed), to_probe, canvas.tokens[0, to_probe].copy(), x0, confidence)


def _probe(backend, canvas: Canvas, kv: kv_state.KVState, positions: np.ndarray, width: int, nfe: int):
    """Predictions at `positions` with each of them masked and everything else visible."""
    window = canvas.window(positions, width)
    probe = dataclasses.replace(canvas, tokens=canvas.tokens.copy())
    probe.tokens[:, positions] = canvas.mask_id
    out = window_step(backend, probe, kv, window)
    if out.readout.x0 is None:
        raise LladaError("revision re-scores with argmax readouts: use temperature 0")
    check_finite(out.readout, window.positions, window.valid, nfe)
    x0, confidence = canvas_wide(canvas, window, out.readout.x0[0],
                                 np.exp(out.readout.logp[0].astype(np.float64)))
    return x0[positions], confidence[positions]
