"""Dual-path progressive revision: the side path's K/V is a fresh recomputation, dense steps never
see a stale slot, commits and revisions stay in the generated region."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax import kv_state
from llada_jax.errors import LladaError
from policies.canvas import Canvas
from policies.registry import make_cache_policy
from policies.revision import NEVER, Revision
from tests.conftest import TINY, jax_backend


def prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY.mask_token_id, 4 + seed % 5)


@settings(max_examples=10)
@given(seed=st.integers(0, 1000), changed=st.integers(1, 12))
def test_refreshed_kv_equals_a_fresh_recomputation(tiny_model, seed, changed):
    """Slots whose token changed get exactly the K/V a full forward of the new canvas gives them,
    provided the rest of the cache is current."""
    rng = np.random.default_rng(seed)
    canvas = Canvas.start(prompt(seed), 24, TINY.mask_token_id, cfg=False, max_len=TINY.max_sequence_length)
    gen = np.arange(canvas.prompt_len, canvas.length)
    canvas.write(gen, rng.integers(0, TINY.mask_token_id, gen.size))
    backend = jax_backend(tiny_model)
    everything = np.arange(canvas.slots)[None]
    fresh = backend.full(canvas.tokens, canvas.valid)
    old_tokens = canvas.tokens.copy()
    moved = np.sort(rng.choice(gen, size=min(changed, 8), replace=False))
    old_tokens[0, moved] = (old_tokens[0, moved] + 1) % TINY.mask_token_id
    stale = backend.full(old_tokens, canvas.valid)
    kv = backend.commit(backend.empty_state(1, canvas.slots), everything, canvas.valid, fresh, canvas.tokens, 0)
    kv = backend.commit(kv, moved[None], np.ones((1, moved.size), bool),
                        type(stale)({}, stale.keys[:, :, moved], stale.values[:, :, moved]), old_tokens[:, moved], 0)
    assert kv_state.stale_slots(kv, canvas.tokens)[0].sum() == moved.size
    policy = Revision(refresh_width=8)
    state = policy.initial_state(backend, canvas)._replace(kv=kv)
    # Stable tokens are only refreshed, never revised: the K/V is the one thing under test here.
    state = state._replace(committed_at=np.where(np.isin(np.arange(canvas.slots), gen), 0, NEVER),
                           stable=np.ones(canvas.slots, bool))
    state, revisions = policy._refresh(backend, canvas, state, nfe=1)
    assert revisions == () and state.refreshes == moved.size
    assert not kv_state.stale_slots(state.kv, canvas.tokens).any()
    got, want = np.asarray(state.kv.keys)[:, 0, moved], np.asarray(fresh.keys)[:, 0, moved]
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


class WatchingBackend:
    """Wraps a backend; fails if a window step could attend to a slot whose K/V is stale."""

    def __init__(self, inner, canvas_ref):
        self.inner, self.canvas_ref, self.windows = inner, canvas_ref, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def window(self, state, visible, ids, positions, valid):
        canvas = self.canvas_ref[0]
        shown = np.asarray(visible) & state.filled
        assert (state.slot_token[shown] == canvas.tokens[shown]).all(), "a stale slot was visible"
        self.windows += 1
        return self.inner.window(state, visible, ids, positions, valid)


@settings(max_examples=8)
@given(spec=st.sampled_from(["dual-cache+revision:0.3", "dual-cache+speculative:1:0.3+revision:0.3",
                             "prefix-cache+revision:0.3:3"]),
       threshold=st.sampled_from([None, 0.2]), seed=st.integers(0, 500))
def test_dense_steps_never_see_stale_kv_and_commits_stay_in_bounds(tiny_model, spec, threshold, seed):
    from policies import decode as decode_mod
    from policies.decode import Schedule, make_rule
    from policies.sampling import Sampler

    canvas_ref = []
    original_start = Canvas.start

    def remember(*args, **kwargs):
        canvas_ref.append(original_start(*args, **kwargs))
        return canvas_ref[-1]

    ids = prompt(seed)
    schedule = Schedule(24, 8, 12)
    backend = WatchingBackend(jax_backend(tiny_model), canvas_ref)
    try:
        Canvas.start = remember
        result = decode_mod.decode(backend, ids, schedule, make_cache_policy(spec), make_rule(schedule, threshold),
                                   Sampler(), mask_id=TINY.mask_token_id, max_len=TINY.max_sequence_length)
    finally:
        Canvas.start = original_start
    assert backend.windows > 0
    first_commits = [p for r in result.trace for p in r.positions]
    assert len(first_commits) == len(set(first_commits)) == 24
    generated = set(range(len(ids), len(ids) + 24))
    assert set(first_commits) == generated
    for record in result.trace:
        for position, old, new in record.revisions:
            assert position in generated and old != new and TINY.mask_token_id not in (old, new)
    assert result.stats["refreshes"] >= 24 - 8  # every finished block's last commits were refreshed
    assert (result.output_ids != TINY.mask_token_id).all()


def test_revision_replaces_a_token_the_model_now_rejects(tiny_model):
    """A committed token the model rejects, when re-scored with that position masked, is replaced and its
    K/V refreshed before the next dense step."""
    from policies.canvas import Block

    backend = jax_backend(tiny_model)
    canvas = Canvas.start(prompt(3), 16, TINY.mask_token_id, cfg=False, max_len=TINY.max_sequence_length)
    policy = Revision(revise_threshold=0.01)
    state = policy.initial_state(backend, canvas)
    block = Block(0, canvas.prompt_len, canvas.prompt_len + 8)
    out, window, state = policy.step(backend, canvas, state, block, 0, 0)
    wrong = (int(out.readout["x0"][0][block.start]) + 7) % TINY.mask_token_id
    canvas.write(np.array([block.start]), np.array([wrong]))
    state = state._replace(committed_at=np.where(np.arange(canvas.slots) == block.start, 0, NEVER))
    out, window, state = policy.step(backend, canvas, state, block, 1, 1)
    probe_x0, probe_confidence = policy._probe(backend, canvas, state, np.array([block.start]))
    assert probe_x0[block.start] != wrong and probe_confidence[block.start] >= 0.01
    none = np.full(canvas.slots, -np.inf)
    state, revisions = policy.after_commit(backend, canvas, state, block, window, np.zeros(canvas.slots, int), none, 1)
    assert revisions == ((block.start, wrong, int(probe_x0[block.start])),)
    assert canvas.tokens[0, block.start] == probe_x0[block.start]
    assert state.kv.slot_token[0, block.start] == probe_x0[block.start]  # refreshed on the side path


def test_revision_needs_a_cached_base():
    with pytest.raises(LladaError, match="needs a cached base policy"):
        make_cache_policy("vanilla+revision")


def test_generate_reports_revisions_and_side_path(tiny_model):
    result = llada_jax.generate(tiny_model, prompt(1), gen_length=24, block_length=8, steps=24,
                                policy="dual-cache+revision:0.2")
    assert set(result.stats) == {"refreshes", "side_seconds"} and result.stats["refreshes"] > 0
    assert result.revisions == sum(len(r.revisions) for r in result.trace)
