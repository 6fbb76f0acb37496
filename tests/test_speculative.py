"""Multi-block speculative decoding: off means identical to the base; on, drafts stay in bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.system.errors import LladaError
from policies.cache_policies import PrefixCache
from policies.registry import make_policy
from policies.speculative import Speculative
from tests.conftest import TINY

BASES = ["vanilla", "prefix-cache", "dual-cache"]


def prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY.mask_token_id, 5 + seed % 4)


@settings(max_examples=10)
@given(base=st.sampled_from(BASES), threshold=st.sampled_from([None, 0.2]), seed=st.integers(0, 500))
@pytest.mark.slow
def test_lookahead_zero_is_the_base_decoder(tiny_model, base, threshold, seed):
    options = dict(gen_length=24, block_length=8, steps=12, threshold=threshold)
    want = llada_jax.generate(tiny_model, prompt(seed), policy=base, **options)
    got = llada_jax.generate(tiny_model, prompt(seed), policy=f"{base}+speculative:0", **options)
    assert got.output_ids.tolist() == want.output_ids.tolist()
    assert [r.positions for r in got.trace] == [r.positions for r in want.trace]


@settings(max_examples=12)
@given(base=st.sampled_from(BASES), lookahead=st.integers(1, 3), draft_threshold=st.sampled_from([0.05, 0.3, 0.9]),
       threshold=st.sampled_from([None, 0.3]), seed=st.integers(0, 500))
@pytest.mark.slow
def test_drafts_are_committed_once_inside_the_canvas_and_lookahead(tiny_model, base, lookahead, draft_threshold,
                                                                    threshold, seed):
    ids = prompt(seed)
    result = llada_jax.generate(tiny_model, ids, gen_length=32, block_length=8, steps=16, threshold=threshold,
                                policy=f"{base}+speculative:{lookahead}:{draft_threshold}")
    committed = [p for r in result.trace for p in r.positions]
    assert len(committed) == len(set(committed)) == 32
    assert all(len(ids) <= p < len(ids) + 32 for p in committed)
    for record in result.trace:
        block_end = len(ids) + 8 * (record.block + 1)
        drafted = record.positions[len(record.positions) - record.drafts:] if record.drafts else ()
        assert all(block_end <= p < block_end + 8 * lookahead for p in drafted)
        assert all(c >= draft_threshold for c in record.confidence[len(record.positions) - record.drafts:])
        assert 0 < record.useful <= record.shape_width
    assert (result.output_ids != TINY.mask_token_id).all()


@pytest.mark.slow
@pytest.mark.parametrize("length", [40, 64])
def test_a_block_over_half_the_canvas_drafts_within_it_on_either_loop(tiny_model, length):
    """Twice the block is wider than the canvas: the window is the canvas (it asked for a shape past the canvas
    and failed), and the host and compiled loops agree."""
    options = dict(gen_length=length, block_length=length, steps=length, policy="dual-cache+speculative", threshold=0.9)
    runs = [llada_jax.generate(tiny_model, prompt(3), loop=loop, **options) for loop in ("host", "compiled")]
    assert runs[0].output_ids.tolist() == runs[1].output_ids.tolist() and runs[0].nfe == runs[1].nfe
    committed = [p for r in runs[0].trace for p in r.positions]
    assert len(committed) == len(set(committed)) == length
    assert all(r.shape_width <= len(prompt(3)) + 2 * length for r in runs[0].trace)


def test_speculation_fills_idle_window_slots(tiny_model):
    """Over dual-cache the window doubles and drafts occupy what the current block no longer needs."""
    options = dict(gen_length=32, block_length=8, steps=32)
    base = llada_jax.generate(tiny_model, prompt(1), policy="dual-cache", **options)
    spec = llada_jax.generate(tiny_model, prompt(1), policy="dual-cache+speculative:1:0.99", **options)
    windows = [r for r in spec.trace if r.kind == "window"]
    assert windows and all(r.shape_width == 16 for r in windows)
    assert sum(r.useful for r in windows) > sum(r.useful for r in base.trace if r.kind == "window")


@pytest.mark.parametrize("spec, message", [
    ("dual-cache+speculative:-1", "lookahead must be a non-negative integer"),
    ("dual-cache+speculative:1:1.5", "draft threshold must be in (0, 1]"),
    ("dual-cache+speculative:x", "bad number"),
    ("dual-cache+fast", "unknown policy modifier 'fast'"),
    ("turbo", "unknown policy 'turbo'"),
])
def test_bad_policy_specs_are_clear_errors(spec, message):
    with pytest.raises(LladaError, match=message.replace("(", r"\(").replace("]", r"\]")):
        make_policy(spec)


def test_policy_spec_builds_the_composition():
    policy = make_policy("prefix-cache+speculative:2:0.8")
    assert isinstance(policy, Speculative) and policy.lookahead == 2 and policy.draft_threshold == 0.8
    assert policy.base == PrefixCache()
