"""The decisions both loops share (`policies.decisions`): each against its plain definition, and numpy and
jax.numpy giving the same answer (the host loop calls them with one, the compiled loop with the other)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from llada_jax.model.readout import first_nonfinite, nonfinite
from policies import decisions
from tests.reference import transfer_counts

KEYS = st.lists(st.sampled_from([-np.inf, -3.0, -1.5, -0.25, 0.0, np.inf]), min_size=1, max_size=24)


def canvas(keys: list[float], picks: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    order = np.asarray(keys, np.float32)
    candidates = np.resize(np.asarray(picks or [True], bool), order.shape)
    return order, candidates


@given(keys=KEYS, picks=st.lists(st.booleans(), max_size=24))
def test_ranks_are_the_sorted_order_of_the_candidates(keys, picks):
    order, candidates = canvas(keys, picks)
    rank = decisions.ranks(np, order, candidates)
    by_key = sorted(np.flatnonzero(candidates), key=lambda p: (-order[p], p))  # ties: the lower position first
    assert [int(rank[p]) for p in by_key] == list(range(len(by_key)))
    np.testing.assert_array_equal(np.asarray(decisions.ranks(jnp, jnp.asarray(order), jnp.asarray(candidates))),
                                  rank)


@given(masked=st.integers(0, 64), steps=st.integers(1, 16))
def test_scheduled_counts_are_llada_s_transfer_counts(masked, steps):
    counts = [int(decisions.scheduled_count(masked, steps, step)) for step in range(steps)]
    assert counts == list(transfer_counts(masked, steps))
    assert [int(decisions.scheduled_count(jnp.int32(masked), steps, jnp.int32(step))) for step in range(steps)] \
        == counts


@given(keys=KEYS, picks=st.lists(st.booleans(), max_size=24), count=st.integers(0, 24),
       cutoff=st.sampled_from([-2.0, -0.5, 0.0]))
def test_commit_rules_pick_by_rank(keys, picks, count, cutoff):
    order, candidates = canvas(keys, picks)
    rank = decisions.ranks(np, order, candidates)
    by_key = sorted(np.flatnonzero(candidates), key=lambda p: (-order[p], p))
    fixed = decisions.fixed_commits(rank, candidates, count)
    assert set(np.flatnonzero(fixed)) == set(by_key[:count])
    confident = order >= cutoff
    threshold = decisions.threshold_commits(rank, candidates, confident)
    assert set(np.flatnonzero(threshold)) == {p for i, p in enumerate(by_key) if i == 0 or confident[p]}
    assert np.array_equal(np.asarray(decisions.threshold_commits(jnp.asarray(rank), jnp.asarray(candidates),
                                                                 jnp.asarray(confident))), threshold)


@given(values=st.lists(st.sampled_from([np.nan, np.inf, -np.inf, 0.0, 1.0]), min_size=1, max_size=12))
def test_nonfinite_is_nan_or_positive_infinity(values):
    array = np.asarray(values, np.float32)
    expected = [v != v or v == np.inf for v in values]
    assert nonfinite(np, array).tolist() == expected
    assert np.asarray(nonfinite(jnp, jnp.asarray(array))).tolist() == expected


@given(values=st.lists(st.sampled_from([np.nan, np.inf, -np.inf, 0.0]), min_size=6, max_size=6),
       valid=st.lists(st.booleans(), min_size=3, max_size=3), rows=st.sampled_from([1, 2]))
def test_first_nonfinite_is_the_first_valid_column_with_nan_or_inf_in_both_loops(values, valid, rows):
    scores = np.resize(np.asarray(values, np.float32), (rows, 3, 2))  # [rows, columns, vocabulary]
    positions = np.asarray([7, 3, 5])
    bad = [valid[c] and any(v != v or v == np.inf for v in scores[:, c].ravel()) for c in range(3)]
    expected = int(positions[bad.index(True)]) if any(bad) else -1
    assert int(first_nonfinite(np, scores, np.asarray(valid), positions, none=-1)) == expected
    assert int(first_nonfinite(jnp, jnp.asarray(scores), jnp.asarray(valid), jnp.asarray(positions), -1)) == expected


@given(in_reads=st.lists(st.booleans(), min_size=1, max_size=16), masked=st.lists(st.booleans(), max_size=16))
def test_a_step_reads_its_masks_or_else_its_first_read_row(in_reads, masked):
    reads = np.asarray(in_reads)
    masks = np.resize(np.asarray(masked or [False], bool), reads.shape)
    rows = decisions.read_rows(np, reads, masks)
    masks_read = [i for i in range(reads.size) if reads[i] and masks[i]]
    first_read = [i for i in range(reads.size) if reads[i]][:1] or [0]
    assert np.flatnonzero(rows).tolist() == (masks_read or first_read)
    assert np.asarray(decisions.read_rows(jnp, jnp.asarray(reads), jnp.asarray(masks))).tolist() == rows.tolist()


@given(drafting=st.lists(st.booleans(), min_size=1, max_size=24), room=st.integers(-2, 24))
def test_a_widened_window_takes_the_first_drafts_that_fit(drafting, room):
    mask = np.asarray(drafting)
    taken = decisions.drafts_taken(np, mask, room)
    assert np.flatnonzero(taken).tolist() == np.flatnonzero(mask)[: max(room, 0)].tolist()
    assert np.asarray(decisions.drafts_taken(jnp, jnp.asarray(mask), room)).tolist() == taken.tolist()


@given(drafting=st.lists(st.booleans(), min_size=8, max_size=24), start=st.integers(0, 4), length=st.integers(1, 4),
       extra=st.integers(0, 8))
def test_a_speculative_window_is_the_block_then_the_drafts_that_fit(drafting, start, length, extra):
    mask = np.asarray(drafting)
    width = length + extra
    positions, valid = decisions.speculative_window(np, start, length, mask, width)
    want = list(range(start, start + length)) + np.flatnonzero(mask)[:extra].tolist()
    assert positions[valid].tolist() == want and valid.tolist() == [i < len(want) for i in range(width)]
    got = decisions.speculative_window(jnp, start, length, jnp.asarray(mask), width)
    assert [np.asarray(part).tolist() for part in got] == [positions.tolist(), valid.tolist()]
