"""The compiled decode loop is the host loop: same tokens, forward passes and per-pass commits (positions,
blocks, widths, useful counts) for every setting it covers; its confidences agree to float32 rounding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.system.errors import LladaError
from llada_jax.system.locations import default_model_dir
from policies.loop_io import log_cutoff
from tests.conftest import TINY

COVERED = ["vanilla", "prefix-cache", "dual-cache", "vanilla+speculative:1:0.3", "prefix-cache+speculative:2:0.4",
           "dual-cache+speculative:3:0.3", "dual-cache+speculative:1:0.2"]


@pytest.fixture(scope="module")
def embedded():
    return llada_jax.load(default_model_dir())


def assert_same_generation(model, ids, **options):
    host = llada_jax.generate(model, ids, loop="host", **options)
    compiled = llada_jax.generate(model, ids, loop="compiled", **options)
    assert compiled.stats["loop"] == "compiled" and compiled.stats["step_call_seconds"] > 0
    assert compiled.output_ids.tolist() == host.output_ids.tolist()
    assert compiled.nfe == host.nfe

    def without_confidence(trace):
        return [dataclasses.replace(record, confidence=()) for record in trace]

    assert without_confidence(compiled.trace) == without_confidence(host.trace)
    for mine, theirs in zip(compiled.trace, host.trace):
        np.testing.assert_allclose(mine.confidence, theirs.confidence, rtol=1e-4, atol=1e-5)
    return host


@settings(max_examples=25)
@given(policy=st.sampled_from(COVERED), threshold=st.sampled_from([None, 0.3, 0.7]),
       prompt_len=st.integers(1, 20), blocks=st.integers(1, 3), block_length=st.sampled_from([4, 8]),
       steps_per_block=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 10_000))
@pytest.mark.slow
def test_compiled_loop_equals_host_loop_on_a_test_checkpoint(tiny_model, policy, threshold, prompt_len, blocks,
                                                            block_length, steps_per_block, seed):
    ids = np.random.default_rng(seed).integers(0, TINY.mask_token_id, prompt_len)
    assert_same_generation(tiny_model, ids, gen_length=blocks * block_length, block_length=block_length,
                           steps=blocks * steps_per_block, policy=policy, threshold=threshold)


@settings(max_examples=12)
@given(policy=st.sampled_from(COVERED + ["dual-cache+speculative"]), threshold=st.sampled_from([None, 0.9]),
       prompt_len=st.integers(3, 60), steps=st.sampled_from([16, 32]), seed=st.integers(0, 10_000))
@pytest.mark.slow
def test_compiled_loop_equals_host_loop_on_the_embedded_model(embedded, policy, threshold, prompt_len, steps, seed):
    ids = np.random.default_rng(seed).integers(10, 90, prompt_len)
    assert_same_generation(embedded, ids, gen_length=32, block_length=8, steps=steps, policy=policy,
                           threshold=threshold)


def test_biases_reach_the_compiled_loop(tiny_model):
    options = dict(gen_length=16, block_length=8, steps=8, policy="dual-cache", logits_eos_inf=True,
                   confidence_eos_eot_inf=True)
    result = assert_same_generation(tiny_model, np.array([3, 4, 5]), **options)
    assert TINY.eos_token_id not in result.output_ids.tolist()


@settings(max_examples=300)
@given(threshold=st.floats(-0.5, 1.5), logp=st.floats(-20.0, 0.0, width=32) | st.just(-np.inf),
       strict=st.booleans())
def test_log_cutoff_decides_as_the_confidence_threshold(threshold, logp, strict):
    """`logp >= cutoff` is the host's comparison of exp(logp) with the threshold (`strict`: above it, as block
    diffusion's rules compare), out-of-range thresholds and -inf included."""
    value = np.float32(logp)
    probability = np.exp(np.float64(value))
    assert (value >= log_cutoff(threshold, strict)) == (probability > threshold if strict else probability >= threshold)


@pytest.mark.parametrize("options, reason", [
    (dict(temperature=0.5), "temperature 0"),
    (dict(cfg_scale=1.0), "no CFG"),
    (dict(policy="dual-cache+revision"), "--loop host"),
])
def test_settings_the_compiled_loop_does_not_cover_are_refused_in_one_line(tiny_model, options, reason):
    with pytest.raises(LladaError, match=reason):
        llada_jax.generate(tiny_model, np.array([3, 4, 5]), gen_length=8, block_length=8, steps=8, loop="compiled",
                           **options)


def test_auto_uses_the_host_loop_where_the_compiled_loop_does_not_reach(tiny_model):
    result = llada_jax.generate(tiny_model, np.array([3, 4, 5]), gen_length=8, block_length=8, steps=8,
                                policy="dual-cache+revision")
    assert result.stats.get("loop") != "compiled"
    with pytest.raises(LladaError, match="unknown loop 'fast'"):
        llada_jax.generate(tiny_model, np.array([3]), gen_length=8, block_length=8, steps=8, loop="fast")


def test_compiled_loop_with_a_live_canvas_is_refused(tiny_model):
    with pytest.raises(LladaError, match="--loop host for a live canvas"):
        llada_jax.generate(tiny_model, np.array([3, 4, 5]), gen_length=8, block_length=8, steps=8, loop="compiled",
                           on_step=lambda canvas, record: None)
