"""Every decoder reproduces the reference loops token for token at temperature 0."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.model.config import LLaDAConfig
from tests import reference
from tests.conftest import TINY, read_all, write_checkpoint

POLICIES = ["vanilla", "prefix-cache", "dual-cache"]


@pytest.fixture(scope="module")
def weights(tiny_dir):
    return read_all(tiny_dir)


@settings(max_examples=15)
@given(policy=st.sampled_from(POLICIES), threshold=st.sampled_from([None, 0.05, 0.3]),
       prompt_len=st.integers(1, 20), blocks=st.integers(1, 3), block_length=st.sampled_from([4, 8]),
       steps_per_block=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 10_000))
@pytest.mark.slow
def test_matches_reference(tiny_model, weights, policy, threshold, prompt_len, blocks, block_length,
                           steps_per_block, seed):
    prompt = np.random.default_rng(seed).integers(0, TINY.mask_token_id, prompt_len)
    gen_length = blocks * block_length
    steps = blocks * steps_per_block
    expected, expected_nfe = reference.generate(weights, TINY, prompt, gen_length, block_length, steps,
                                                policy, threshold)
    result = llada_jax.generate(tiny_model, prompt, gen_length=gen_length, block_length=block_length,
                                steps=steps, policy=policy, threshold=threshold)
    assert result.output_ids.tolist() == expected.tolist()
    assert result.nfe == expected_nfe


@pytest.mark.slow
def test_full_vocabulary_sharded_bf16_checkpoint(tmp_path):
    """LLaDA-8B's vocabulary and default special ids, stored as sharded bf16 and run in float32."""
    config = LLaDAConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, mlp_hidden_size=32, vocab_size=126464,
                         embedding_size=126464, max_sequence_length=64)
    model_dir = write_checkpoint(tmp_path / "full_vocab", config, stored_dtype="bfloat16", shard_bytes=2_000_000)
    model = llada_jax.load(model_dir)
    assert model.config.mask_token_id == 126336 and model.config.eos_token_id == 126081
    prompt = np.random.default_rng(0).integers(0, 126000, (1, 7))
    for policy in POLICIES:
        expected, nfe = reference.generate(read_all(model_dir), config, prompt[0], 16, 8, 8, policy, None)
        result = llada_jax.generate(model, prompt, gen_length=16, block_length=8, steps=8, policy=policy)
        assert result.output_ids.tolist() == expected.tolist() and result.nfe == nfe


@settings(max_examples=6)
@given(scale=st.sampled_from([0.5, 1.0, 2.0]), prompt_len=st.integers(2, 12), seed=st.integers(0, 10_000))
def test_classifier_free_guidance_matches_reference(tiny_model, weights, scale, prompt_len, seed):
    prompt = np.random.default_rng(seed).integers(0, TINY.mask_token_id, prompt_len)
    expected, _ = reference.generate(weights, TINY, prompt, 16, 8, 8, cfg_scale=scale)
    result = llada_jax.generate(tiny_model, prompt, gen_length=16, block_length=8, steps=8, cfg_scale=scale)
    assert result.output_ids.tolist() == expected.tolist()
