"""The KV state is a value: commits return new states, record provenance, and reject bad slots."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llada_jax.model import kv_state
from llada_jax.model.readout import StepOutput
from llada_jax.system.errors import LladaError
from tests.conftest import TINY, jax_backend

SLOTS = 16


def proposal(width: int, seed: int):
    shape = (TINY.n_layers, 1, width, TINY.n_kv_heads, TINY.head_dim)
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=shape), jnp.float32), jnp.asarray(rng.normal(size=shape), jnp.float32)


@settings(max_examples=25, deadline=None)
@given(positions=st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=8, unique=True),
       write=st.data(), seed=st.integers(0, 1000))
def test_commit_writes_only_flagged_slots_and_leaves_the_old_state_alone(tiny_model, positions, write, seed):
    width = len(positions)
    flags = np.array(write.draw(st.lists(st.booleans(), min_size=width, max_size=width)))
    keys, values = proposal(width, seed)
    tokens = np.arange(100, 100 + width)[None]
    backend = jax_backend(tiny_model)
    before = backend.empty_state(1, SLOTS)
    after = backend.commit(before, np.array(positions)[None], flags[None], StepOutput({}, keys, values), tokens, nfe=5)
    assert not before.filled.any() and float(jnp.abs(before.keys).max()) == 0.0
    written = np.array(positions)[flags]
    assert sorted(np.flatnonzero(after.filled)) == sorted(written)
    for i, pos in enumerate(positions):
        if flags[i]:
            assert after.slot_token[0, pos] == 100 + i and after.slot_nfe[0, pos] == 5
            np.testing.assert_array_equal(np.asarray(after.keys)[:, 0, pos], np.asarray(keys)[:, 0, i])
            np.testing.assert_array_equal(np.asarray(after.values)[:, 0, pos], np.asarray(values)[:, 0, i])
    untouched = np.setdiff1d(np.arange(SLOTS), written)
    assert float(jnp.abs(after.keys[:, 0, untouched]).max()) == 0.0


def test_stale_slots_are_those_whose_token_changed(tiny_model):
    backend = jax_backend(tiny_model)
    state = backend.commit(backend.empty_state(1, SLOTS), np.arange(4)[None], np.ones((1, 4), bool),
                           StepOutput({}, *proposal(4, 0)), np.array([[7, 8, 9, 10]]), nfe=0)
    canvas = np.zeros((1, SLOTS), np.int64)
    canvas[0, :4] = [7, 99, 9, 10]
    assert np.flatnonzero(kv_state.stale_slots(state, canvas)).tolist() == [1]


def test_commit_outside_the_cache_is_refused(tiny_model):
    backend = jax_backend(tiny_model)
    with pytest.raises(LladaError, match="outside the 16 cache slots"):
        backend.commit(backend.empty_state(1, SLOTS), np.array([[3, SLOTS]]), np.ones((1, 2), bool),
                       StepOutput({}, *proposal(2, 0)), np.array([[1, 2]]), nfe=0)
