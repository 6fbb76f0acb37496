"""Dual-path progressive revision: the side path's K/V is a fresh recomputation, dense steps see a
stale slot only for the one step its refresh runs beside, commits and revisions stay in the generated
region."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.model import kv_state
from llada_jax.system.errors import LladaError
from policies.backend import SideBackend
from policies.canvas import Block, Canvas
from policies.loop import decode, dense_step
from policies.registry import make_policy
from policies.revision import NEVER, Revision
from policies.sampling import Sampler
from policies.schedule import Schedule, make_rule
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
    everything = np.arange(canvas.padded_length)[None]
    fresh = backend.full(canvas.tokens, canvas.valid)
    old_tokens = canvas.tokens.copy()
    moved = np.sort(rng.choice(gen, size=min(changed, 8), replace=False))
    old_tokens[0, moved] = (old_tokens[0, moved] + 1) % TINY.mask_token_id
    stale = backend.full(old_tokens, canvas.valid)
    kv = backend.commit(backend.empty_state(1, canvas.padded_length), everything, canvas.valid, fresh, canvas.tokens, 0)
    kv = backend.commit(kv, moved[None], np.ones((1, moved.size), bool),
                        type(stale)({}, stale.keys[:, :, moved], stale.values[:, :, moved]), old_tokens[:, moved], 0)
    assert kv_state.stale_slots(kv, canvas.tokens)[0].sum() == moved.size
    policy = Revision()
    with policy.side_path(backend, canvas) as session:
        # Stable tokens are only refreshed, never re-scored: the K/V is the one thing under test here.
        session.committed_at = np.where(np.isin(np.arange(canvas.padded_length), gen), 0, NEVER)
        session.stable = np.ones(canvas.padded_length, bool)
        session._submit_job(kv, canvas.full_window(), nfe=1)
        kv, merged = session.merge(kv, nfe=1)
    assert merged == () and session.refreshes == moved.size and session.probes == 0
    assert not kv_state.stale_slots(kv, canvas.tokens).any()
    got, want = np.asarray(kv.keys)[:, 0, moved], np.asarray(fresh.keys)[:, 0, moved]
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


class WatchingBackend:
    """Wraps the dense path's backend (the side path runs on the inner one, inline) and fails if a dense
    step attends to a slot whose K/V is stale, unless its token changed after the previous dense step."""

    def __init__(self, inner, canvas_ref):
        self.inner, self.canvas_ref, self.windows, self.stale_seen = inner, canvas_ref, 0, 0
        self.previous = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def side_backend(self):
        return SideBackend(self.inner, lambda kv: kv, lambda out: out)

    def full(self, tokens, valid, reads=None):
        self.previous = np.array(tokens)
        return self.inner.full(tokens, valid, reads)

    def window(self, state, visible, ids, positions, valid, reads=None):
        tokens = self.canvas_ref[0].tokens
        shown = np.asarray(visible) & state.filled
        stale = shown & (state.slot_token != tokens)
        assert (self.previous[stale] != tokens[stale]).all(), "a slot stale since before the last step was visible"
        self.stale_seen += int(stale.sum())
        self.previous = tokens.copy()
        self.windows += 1
        return self.inner.window(state, visible, ids, positions, valid, reads)


@settings(max_examples=8)
@given(spec=st.sampled_from(["dual-cache+revision:0.3", "dual-cache+speculative:1:0.3+revision:0.3",
                             "prefix-cache+revision:0.3:3"]),
       threshold=st.sampled_from([None, 0.2]), seed=st.integers(0, 500))
def test_dense_steps_never_see_stale_kv_and_commits_stay_in_bounds(tiny_model, spec, threshold, seed):
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
        result = decode(backend, ids, schedule, make_policy(spec), make_rule(schedule, threshold),
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
    assert result.stats["refreshes"] > 0 and result.stats["probes"] > 0
    assert (result.output_ids != TINY.mask_token_id).all()


def dense(backend, canvas, policy, session, block, kv, step):
    """The decode loop's dense step `step` of `block` (also the forward pass count here)."""
    steps = dense_step(canvas, kv, policy.plan(canvas, block, step, kv), session, step)
    try:
        call = next(steps)
        while True:
            call = steps.send(call.run(backend))
    except StopIteration as finished:
        return finished.value


def test_revision_replaces_a_token_the_model_now_rejects(tiny_model):
    """A committed token the model rejects when re-scored with it masked is replaced at the merge after
    the next dense step, and its K/V is current after the merge that follows."""
    backend = jax_backend(tiny_model)
    canvas = Canvas.start(prompt(3), 16, TINY.mask_token_id, cfg=False, max_len=TINY.max_sequence_length)
    policy = Revision(revise_threshold=0.01)
    block = Block(0, canvas.prompt_len, canvas.prompt_len + 8)
    unsure = np.zeros(canvas.padded_length)
    with policy.side_path(backend, canvas) as session:
        kv = backend.empty_state(1, canvas.padded_length)
        out, window, _, kv, merged = dense(backend, canvas, policy, session, block, kv, 0)
        expected = int(out.readout.x0[0][block.start])  # the probe's canvas is exactly the prefill's canvas
        wrong = (expected + 7) % TINY.mask_token_id
        canvas.write(np.array([block.start]), np.array([wrong]))
        session.submit(kv, window, unsure, 0)
        assert merged == () and canvas.tokens[0, block.start] == wrong
        out, window, _, kv, merged = dense(backend, canvas, policy, session, block, kv, 1)
        assert merged == ((block.start, wrong, expected),) and canvas.tokens[0, block.start] == expected
        assert kv.slot_token[0, block.start] != expected  # stale until the side path's next merge
        session.submit(kv, window, unsure, 1)
        out, window, _, kv, merged = dense(backend, canvas, policy, session, block, kv, 2)
        assert kv.slot_token[0, block.start] == expected


@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_a_final_revision_is_settled_by_another_rescore(tiny_model, rounds):
    """A revision made when the generation ends is re-scored once more (it confirms here, so settling
    stops after one round), and that round refreshes its K/V; with no settle rounds it is not. The reviser
    returns the revision and leaves the canvas to the loop."""
    backend = jax_backend(tiny_model)
    canvas = Canvas.start(prompt(3), 16, TINY.mask_token_id, cfg=False, max_len=TINY.max_sequence_length)
    policy = Revision(revise_threshold=0.01, settle_rounds=rounds)
    block = Block(0, canvas.prompt_len, canvas.prompt_len + 8)
    with policy.side_path(backend, canvas) as session:
        kv = backend.empty_state(1, canvas.padded_length)
        out, window, _, kv, _ = dense(backend, canvas, policy, session, block, kv, 0)
        expected = int(out.readout.x0[0][block.start])
        wrong = (expected + 7) % TINY.mask_token_id
        canvas.write(np.array([block.start]), np.array([wrong]))
        session.submit(kv, window, np.zeros(canvas.padded_length), 0)
        kv, revisions = session.finish(kv)
    assert revisions == ((block.start, wrong, expected),) and canvas.tokens[0, block.start] == wrong
    settled = min(rounds, 1)
    assert session.probes == 1 + settled and session.confirmations[block.start] == settled
    assert (kv.slot_token[0, block.start] == expected) == bool(settled)


def test_revision_needs_a_cached_base():
    with pytest.raises(LladaError, match="needs a cached base policy"):
        make_policy("vanilla+revision")


def test_generate_reports_revisions_and_side_path(tiny_model):
    result = llada_jax.generate(tiny_model, prompt(1), gen_length=24, block_length=8, steps=24,
                                policy="dual-cache+revision:0.2")
    assert set(result.stats) == {"refreshes", "probes", "side_seconds", "side_wait_seconds",
                                 "side_hidden_fraction", "side_concurrent", "step_call_seconds"}
    assert 0 < result.stats["step_call_seconds"] < result.wall_s
    assert result.stats["refreshes"] > 0 and result.stats["probes"] > 0 and not result.stats["side_concurrent"]
    assert result.revisions == sum(len(r.revisions) for r in result.trace)
