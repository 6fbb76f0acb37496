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
each keeps most neighbours visible. The job runs while dense step t+1 computes (on the host with XLA under an IREE
dense path; inline otherwise) and is merged right after that dense step: refreshed K/V go into slots
that are still stale, and re-scores confirm or revise tokens. Invariant: a dense step attends to a stale
slot only if it went stale after the previous dense step (a draft or revision then sees its previous
K/V for one step); the merge makes it current before the next dense step.

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

import dataclasses
from typing import ClassVar, NamedTuple

import numpy as np

from llada_jax import kv_state
from llada_jax.errors import LladaError
from llada_jax.readout import check_finite
from llada_jax.shapes import bucket
from policies.cache_policies import CachePolicy, DualCache, PrefixCache, run_full
from policies.canvas import Block, Canvas, Window
from policies.loop import canvas_wide
from policies.side_path import SidePath, side_path_for

NEVER = -1


class SideResult(NamedTuple):
    """What a side job found, against the snapshot it was given."""

    refreshed: tuple              # (window, [B, W] tokens, StepOutput) per refresh step
    probed: np.ndarray            # positions re-scored
    probed_tokens: np.ndarray     # the tokens they held
    x0: np.ndarray                # the model's choice at each, with it masked
    confidence: np.ndarray


class RevisionState(NamedTuple):
    kv: kv_state.KVState
    stable: np.ndarray          # [S] bool: final tokens
    confirmations: np.ndarray   # [S] int: agreeing re-scorings since commit or revision
    committed_at: np.ndarray    # [S] int: dense step of the last commit/revision, NEVER if masked
    belief: np.ndarray          # [S] float: confidence of the current token when committed or revised to
    side: SidePath
    pending: object = None      # Future[SideResult] of the job submitted after the last dense step
    merged: tuple = ()          # revisions merged during the current step: (position, old, new)
    refreshes: int = 0          # slots recomputed by the side path
    probes: int = 0             # tokens re-scored by the side path
    last_nfe: int = 0           # the last dense step


@dataclasses.dataclass(frozen=True)
class Revision(CachePolicy):
    base: CachePolicy = DualCache()
    revise_threshold: float = 0.5
    confirmations: int = 2
    stable_confidence: float = 0.99
    side_width: int = 8
    settle_rounds: int = 2        # re-scoring rounds after the last dense step while revisions continue

    name: ClassVar[str] = "revision"
    uses_cache: ClassVar[bool] = True
    stops_when_filled: ClassVar[bool] = True

    def __post_init__(self):
        if not hasattr(self.base, "window_plan") or not isinstance(_innermost(self.base), (DualCache, PrefixCache)):
            raise LladaError("revision needs a cached base policy (prefix-cache or dual-cache)")
        if not 0.0 < self.revise_threshold <= 1.0 or not 0.0 < self.stable_confidence <= 1.0:
            raise LladaError("revision thresholds must be in (0, 1]")
        if self.confirmations < 1 or self.side_width < 1:
            raise LladaError("revision confirmations and probe width must be >= 1")
        if self.settle_rounds < 0:
            raise LladaError(f"revision settle rounds must be >= 0, got {self.settle_rounds}")

    def initial_state(self, backend, canvas: Canvas) -> RevisionState:
        slots = canvas.slots
        return RevisionState(backend.empty_state(canvas.tokens.shape[0], slots), np.zeros(slots, bool),
                             np.zeros(slots, np.int64), np.full(slots, NEVER, np.int64), np.zeros(slots),
                             side_path_for(backend))

    def step(self, backend, canvas: Canvas, state: RevisionState, block: Block, step: int, nfe: int):
        """Dense step, then merge of the side job that ran meanwhile, then commit of the window's K/V."""
        if not state.kv.filled.any():  # prefill: the only full-canvas step
            out, window = run_full(backend, canvas)
        else:
            window = canvas.window(*self._dense_plan(canvas, state.kv, block))
            out = _window_step(backend, canvas, state.kv, window)
        input_tokens = canvas.tokens[:, window.positions].copy()
        state = self._merge(backend, canvas, state, nfe)
        kv = _commit(backend, state.kv, window, window.valid, out, input_tokens, nfe)
        return out, window, state._replace(kv=kv)

    def drafts(self, x0, confidence, canvas, block):
        return self.base.drafts(x0, confidence, canvas, block)

    def useful(self, window, canvas, block):
        return self.base.useful(window, canvas, block)

    def after_commit(self, backend, canvas: Canvas, state: RevisionState, block: Block, window: Window,
                     x0: np.ndarray, confidence: np.ndarray, nfe: int):
        """Record new commits and hand the side path its job; report the revisions merged this step."""
        state = _mark_new_commits(state, canvas, confidence, nfe, self.stable_confidence)
        return self._submit(canvas, state._replace(merged=()), window, nfe), state.merged

    def _submit(self, canvas: Canvas, state: RevisionState, window: Window, nfe: int) -> RevisionState:
        """Hand the side path a job over a snapshot: refresh stale slots, re-score the window's unstable tokens."""
        computed = window.positions[window.valid]
        unstable = computed[~state.stable[computed] & (state.committed_at[computed] != NEVER)]
        snapshot = dataclasses.replace(canvas, tokens=canvas.tokens.copy())
        future = state.side.submit(self._side_job, state.kv, snapshot, np.sort(unstable), nfe)
        return state._replace(pending=future, last_nfe=nfe)

    def finish(self, backend, canvas: Canvas, state: RevisionState):
        """Merge the last job, then settle: re-score the answer's unstable tokens again while the
        previous merge revised any (up to `settle_rounds`). Returns every revision made here."""
        state = self._merge(backend, canvas, state, state.last_nfe)
        revisions = list(state.merged)
        answer = canvas.window(np.arange(canvas.prompt_len, canvas.length))
        for _ in range(self.settle_rounds):
            if not state.merged:
                break
            state = self._submit(canvas, state._replace(merged=()), answer, state.last_nfe)
            state = self._merge(backend, canvas, state, state.last_nfe)
            revisions += state.merged
        state.side.close()
        return state._replace(merged=()), tuple(revisions)

    def stats(self, state: RevisionState) -> dict:
        return {"refreshes": state.refreshes, "probes": state.probes, **state.side.stats()}

    def _dense_plan(self, canvas: Canvas, kv: kv_state.KVState, block: Block):
        """(positions, width): the carry (stale committed slots of the previous block), then the base
        policy's window; speculative drafts give way to the carry when the width is fixed."""
        length = block.end - block.start
        start = max(canvas.prompt_len, block.start - length)
        stale = kv_state.stale_slots(kv, canvas.tokens)[0] & ~canvas.masked
        carry = start + np.flatnonzero(stale[start: block.start])
        positions, width = self.base.window_plan(canvas, block)
        positions = np.concatenate([carry, positions])
        if width is None:
            return positions, None
        keep = len(carry) + length
        return positions[: max(width, keep)], max(width, bucket(keep, canvas.slots))

    def _side_job(self, side_backend, kv: kv_state.KVState, canvas: Canvas, to_probe: np.ndarray,
                  nfe: int) -> SideResult:
        """Refresh every stale committed slot, then re-score `to_probe` against the refreshed cache."""
        width = bucket(min(self.side_width, canvas.slots), canvas.slots)  # a declared shape
        stale = np.flatnonzero(kv_state.stale_slots(kv, canvas.tokens)[0] & ~canvas.masked)
        refreshed = []
        for start in range(0, stale.size, width):  # later chunks see earlier ones refreshed
            window = canvas.window(stale[start: start + width], width)
            tokens = canvas.tokens[:, window.positions].copy()
            out = _window_step(side_backend, canvas, kv, window)
            kv = _commit(side_backend, kv, window, window.valid, out, tokens, nfe)
            refreshed.append((window, tokens, out))
        x0 = np.zeros(to_probe.size, np.int64)
        confidence = np.zeros(to_probe.size)
        groups = max(min(2, to_probe.size), -(-to_probe.size // width))
        for group in range(groups):
            chosen = np.arange(group, to_probe.size, groups)
            x0[chosen], confidence[chosen] = self._probe(side_backend, canvas, kv, to_probe[chosen], width, nfe)
        return SideResult(tuple(refreshed), to_probe, canvas.tokens[0, to_probe].copy(), x0, confidence)

    def _probe(self, backend, canvas: Canvas, kv: kv_state.KVState, positions: np.ndarray, width: int, nfe: int):
        """Predictions at `positions` with each of them masked and everything else visible."""
        window = canvas.window(positions, width)
        probe = dataclasses.replace(canvas, tokens=canvas.tokens.copy())
        probe.tokens[:, positions] = canvas.mask_id
        out = _window_step(backend, probe, kv, window)
        if "x0" not in out.readout:
            raise LladaError("revision re-scores with argmax readouts: use temperature 0")
        check_finite(out.readout, window.positions, window.valid, nfe)
        x0, confidence = canvas_wide(canvas, window, out.readout["x0"][0],
                                     np.exp(out.readout["logp"][0].astype(np.float64)))
        return x0[positions], confidence[positions]

    def _merge(self, backend, canvas: Canvas, state: RevisionState, nfe: int) -> RevisionState:
        """Apply the pending side job: its K/V where the slot is still stale, then its re-scores."""
        if state.pending is None:
            return state._replace(merged=())
        found: SideResult = state.side.join(state.pending)
        kv = state.kv
        for window, tokens, out in found.refreshed:
            still = (kv.slot_token[:, window.positions] != tokens) & (canvas.tokens[:, window.positions] == tokens)
            kv = _commit(backend, kv, window, window.valid & still.all(axis=0), state.side.to_dense(out), tokens, nfe)
        refreshed = sum(int(window.valid.sum()) for window, _, _ in found.refreshed)
        state = state._replace(kv=kv, pending=None, refreshes=state.refreshes + refreshed,
                               probes=state.probes + len(found.probed))
        return self._rescore(canvas, state, found, nfe)

    def _rescore(self, canvas: Canvas, state: RevisionState, found: SideResult, nfe: int) -> RevisionState:
        stable, confirmations, committed_at = state.stable.copy(), state.confirmations.copy(), state.committed_at.copy()
        belief = state.belief.copy()
        revisions = []
        for p, token, choice, confidence in zip(found.probed, found.probed_tokens, found.x0, found.confidence):
            if stable[p] or canvas.tokens[0, p] != token:
                continue
            if choice == token:
                confirmations[p] += 1
                stable[p] = confirmations[p] >= self.confirmations
            elif confidence >= self.revise_threshold and confidence > belief[p]:
                canvas.write(np.array([p]), np.array([choice]))
                revisions.append((int(p), int(token), int(choice)))
                confirmations[p] = 0
                committed_at[p] = nfe
                belief[p] = confidence
        return state._replace(stable=stable, confirmations=confirmations, committed_at=committed_at, belief=belief,
                              merged=tuple(revisions))


def _innermost(policy):
    while hasattr(policy, "base"):
        policy = policy.base
    return policy


def _window_step(backend, canvas: Canvas, kv: kv_state.KVState, window: Window):
    """A window step against every other filled slot (the window's own slots are computed in it)."""
    rows = canvas.tokens.shape[0]
    visible = canvas.valid.copy()
    visible[:, window.positions[window.valid]] = False
    positions = np.broadcast_to(window.positions, (rows, len(window.positions)))
    valid = np.broadcast_to(window.valid, positions.shape)
    return backend.window(kv, visible, canvas.tokens[:, window.positions], positions, valid)


def _commit(backend, kv: kv_state.KVState, window: Window, keep: np.ndarray, out, tokens: np.ndarray, nfe: int):
    """Write `out`'s K/V at the window's positions where `keep`, recorded as computed from `tokens`."""
    rows = tokens.shape[0]
    positions = np.broadcast_to(window.positions, (rows, len(window.positions)))
    return backend.commit(kv, positions, np.broadcast_to(window.valid & keep, positions.shape), out, tokens, nfe)


def _mark_new_commits(state: RevisionState, canvas: Canvas, confidence: np.ndarray, nfe: int, stable_bar: float):
    """Record this step's new commits; very confident ones are stable at once."""
    new = (state.committed_at == NEVER) & ~canvas.masked
    new[: canvas.prompt_len] = False
    new[canvas.length:] = False
    committed_at = np.where(new, nfe, state.committed_at)
    stable = state.stable | (new & (confidence >= stable_bar))
    belief = np.where(new, confidence, state.belief)
    return state._replace(committed_at=committed_at, stable=stable, belief=belief)
