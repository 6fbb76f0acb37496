"""The declared shape set: every length pads to the smallest declared shape that holds it, wasting at most
1/8 of the step once steps are long enough for padding to cost compute."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llada_jax.model.shapes import GRANULE, LARGEST, LENGTH_BUCKETS, bucket
from llada_jax.system.errors import LladaError


@given(length=st.integers(1, LARGEST))
def test_a_length_pads_to_the_smallest_declared_shape(length):
    size = bucket(length)
    assert size in LENGTH_BUCKETS and size >= length
    assert all(smaller < length for smaller in LENGTH_BUCKETS if smaller < size)
    assert size - length < max(GRANULE, length / 8)


@given(length=st.integers(1, 4096), limit=st.integers(1, 4096))
def test_the_limit_caps_the_shape(length, limit):
    if length > limit:
        with pytest.raises(LladaError, match="exceeds the limit"):
            bucket(length, limit)
    else:
        assert length <= bucket(length, limit) == min(bucket(length), limit)


def test_the_set_is_small_and_the_issue_canvases_fit_exactly():
    assert len(LENGTH_BUCKETS) < 70 and LENGTH_BUCKETS == tuple(sorted(set(LENGTH_BUCKETS)))
    assert (bucket(64 + 128), bucket(96), bucket(66), bucket(88)) == (192, 96, 96, 96)
