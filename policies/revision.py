"""Dual-path progressive revision: committed tokens stay revisable until confirmed, and the K/V of
tokens that changed is refreshed on a side path instead of by full-canvas forwards.

Dense path: one full prefill, then only the base policy's window steps (dual-cache, prefix-cache, or
speculative over either); each step's window K/V is committed to the KV state. No block-start full
forward: the side path keeps the cache current.

Revision: a committed, still *unstable* token is re-scored whenever the dense window covers it, by a
side-path probe that masks it in the input (LLaDA is trained to predict masked positions only; its
output at a visible token is not a prediction). If the model's argmax agrees, that is a confirmation; after `confirmations` of them,
or when committed at confidence >= `stable_confidence`, the token is *stable*: final, and so is its
K/V. If the argmax disagrees at confidence >= `revise_threshold` (so the current token has p <= 1 - that),
the token is revised: replaced by the new argmax. (Replaced, not re-masked: a mask left in a finished
block would never be decoded again, since the loop only fills the current block.)

Side path: after the commits of a step, committed slots whose cached K/V was computed from another
token (`slot_token != canvas`: just committed, drafted, or revised) are recomputed by fixed-shape
refresh steps of `refresh_width` slots against the rest of the cache, most recent changes first,
until none is left. Invariant: a dense step never attends to a stale slot (a slot still stale would
be hidden from it). Here the side path runs through the same backend, after the dense step; its time is
measured separately.
"""

from __future__ import annotations

import dataclasses
import time
from typing import ClassVar, NamedTuple

import numpy as np

from llada_jax import kv_state
from llada_jax.errors import LladaError
from policies.cache import CachePolicy, DualCache, PrefixCache, commit_window, run_full
from policies.canvas import Block, Canvas, Window
from policies.decode import canvas_wide

NEVER = -1


class RevisionState(NamedTuple):
    kv: kv_state.KVState
    stable: np.ndarray          # [S] bool: final tokens
    confirmations: np.ndarray   # [S] int: agreeing re-scorings since commit or revision
    committed_at: np.ndarray    # [S] int: dense step of the last commit/revision, NEVER if masked
    refreshes: int = 0          # slots recomputed by the side path
    side_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Revision(CachePolicy):
    base: CachePolicy = DualCache()
    revise_threshold: float = 0.9
    confirmations: int = 2
    stable_confidence: float = 0.99
    refresh_width: int = 8

    name: ClassVar[str] = "revision"
    uses_cache: ClassVar[bool] = True
    stops_when_filled: ClassVar[bool] = True

    def __post_init__(self):
        if not hasattr(self.base, "window_plan") or not isinstance(_innermost(self.base), (DualCache, PrefixCache)):
            raise LladaError("revision needs a cached base policy (prefix-cache or dual-cache)")
        if not 0.0 < self.revise_threshold <= 1.0 or not 0.0 < self.stable_confidence <= 1.0:
            raise LladaError("revision thresholds must be in (0, 1]")
        if self.confirmations < 1 or self.refresh_width < 1:
            raise LladaError("revision confirmations and refresh width must be >= 1")

    def initial_state(self, backend, canvas: Canvas) -> RevisionState:
        slots = canvas.slots
        return RevisionState(backend.empty_state(canvas.tokens.shape[0], slots), np.zeros(slots, bool),
                             np.zeros(slots, np.int64), np.full(slots, NEVER, np.int64))

    def step(self, backend, canvas: Canvas, state: RevisionState, block: Block, step: int, nfe: int):
        kv = state.kv
        if not kv.filled.any():  # prefill: the only full-canvas step
            out, window = run_full(backend, canvas)
        else:
            positions, width = self.base.window_plan(canvas, block)
            window = canvas.window(positions, width)
            out = _window_step(backend, canvas, kv, window)
        kv = commit_window(backend, kv, out, window, canvas, np.ones(len(window.positions), bool), nfe)
        return out, window, state._replace(kv=kv)

    def drafts(self, x0, confidence, canvas, block):
        return self.base.drafts(x0, confidence, canvas, block)

    def useful(self, window, canvas, block):
        return self.base.useful(window, canvas, block)

    def after_commit(self, backend, canvas: Canvas, state: RevisionState, block: Block, window: Window,
                     x0: np.ndarray, confidence: np.ndarray, nfe: int):
        state = _mark_new_commits(state, canvas, confidence, nfe, self.stable_confidence)
        started = time.perf_counter()
        state, _ = self._refresh(backend, canvas, state, nfe)
        computed = window.positions[window.valid]
        unstable = computed[~state.stable[computed] & (state.committed_at[computed] != NEVER)
                            & (state.committed_at[computed] != nfe)]
        revisions: tuple = ()
        for start in range(0, unstable.size, self.refresh_width):
            chunk = unstable[start: start + self.refresh_width]
            probe_x0, probe_confidence = self._probe(backend, canvas, state, chunk)
            state, found = self._rescore(canvas, state, chunk, probe_x0, probe_confidence, nfe)
            revisions += found
        if revisions:
            state, _ = self._refresh(backend, canvas, state, nfe)
        state = state._replace(side_seconds=state.side_seconds + time.perf_counter() - started)
        return state, revisions

    def _probe(self, backend, canvas: Canvas, state: RevisionState, positions: np.ndarray):
        """Re-score committed tokens the way the model was trained to predict: each masked in the input,
        everything else (current, non-stale) visible. The probe's K/V are discarded."""
        window = canvas.window(positions, self.refresh_width)
        probe = dataclasses.replace(canvas, tokens=canvas.tokens.copy())
        probe.tokens[:, positions] = canvas.mask_id
        out = _window_step(backend, probe, state.kv, window, hide=kv_state.stale_slots(state.kv, canvas.tokens))
        if "x0" not in out.readout:
            raise LladaError("revision re-scores with argmax readouts: use temperature 0")
        return canvas_wide(canvas, window, out.readout["x0"][0], np.exp(out.readout["logp"][0].astype(np.float64)))

    def _rescore(self, canvas: Canvas, state: RevisionState, positions, x0, confidence, nfe: int):
        """Confirm or revise committed, unstable tokens among `positions` (not those committed just now)."""
        stable, confirmations, committed_at = state.stable.copy(), state.confirmations.copy(), state.committed_at.copy()
        revisions = []
        for p in positions:
            if stable[p] or committed_at[p] in (NEVER, nfe):
                continue
            current = int(canvas.tokens[0, p])
            if x0[p] == current:
                confirmations[p] += 1
                stable[p] = confirmations[p] >= self.confirmations
            elif confidence[p] >= self.revise_threshold:
                new = int(x0[p])
                canvas.write(np.array([p]), np.array([new]))
                revisions.append((int(p), current, new))
                confirmations[p] = 0
                committed_at[p] = nfe
        return state._replace(stable=stable, confirmations=confirmations, committed_at=committed_at), tuple(revisions)

    def _refresh(self, backend, canvas: Canvas, state: RevisionState, nfe: int):
        """Side path: recompute K/V of every committed slot whose token changed, `refresh_width` slots
        per refresh step, newest changes first (a slot left stale would be hidden from the dense path)."""
        revisions: tuple = ()
        for _ in range(canvas.length):  # bounded: each pass refreshes at least one stale slot
            state, found = self._refresh_once(backend, canvas, state, nfe)
            if found is None:
                return state, revisions
            revisions += found
        raise AssertionError("side path did not converge")

    def _refresh_once(self, backend, canvas: Canvas, state: RevisionState, nfe: int):
        kv = state.kv
        stale = np.flatnonzero(kv_state.stale_slots(kv, canvas.tokens)[0] & ~canvas.masked)
        if stale.size == 0:
            return state, None
        order = np.argsort(-state.committed_at[stale], kind="stable")
        chosen = np.sort(stale[order][: self.refresh_width])
        window = canvas.window(chosen, self.refresh_width)
        out = _window_step(backend, canvas, kv, window)
        kv = commit_window(backend, kv, out, window, canvas, np.ones(self.refresh_width, bool), nfe)
        return state._replace(kv=kv, refreshes=state.refreshes + len(chosen)), ()

    def stats(self, state: RevisionState) -> dict:
        return {"refreshes": state.refreshes, "side_seconds": state.side_seconds}


def _innermost(policy):
    while hasattr(policy, "base"):
        policy = policy.base
    return policy


def _window_step(backend, canvas: Canvas, kv: kv_state.KVState, window: Window, hide=None):
    """A window step that never attends to a stale slot (nor to the window's own cached slots).
    `hide`: slots to treat as stale (a probe's canvas differs from the one the cache tracks)."""
    rows = canvas.tokens.shape[0]
    stale = kv_state.stale_slots(kv, canvas.tokens) if hide is None else hide
    visible = canvas.valid & ~stale
    visible[:, window.positions[window.valid]] = False
    positions = np.broadcast_to(window.positions, (rows, len(window.positions)))
    valid = np.broadcast_to(window.valid, positions.shape)
    return backend.window(kv, visible, canvas.tokens[:, window.positions], positions, valid)


def _mark_new_commits(state: RevisionState, canvas: Canvas, confidence: np.ndarray, nfe: int, stable_bar: float):
    """Record this step's new commits; very confident ones are stable at once."""
    new = (state.committed_at == NEVER) & ~canvas.masked
    new[: canvas.prompt_len] = False
    new[canvas.length:] = False
    committed_at = np.where(new, nfe, state.committed_at)
    stable = state.stable | (new & (confidence >= stable_bar))
    return state._replace(committed_at=committed_at, stable=stable)
