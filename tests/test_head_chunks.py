"""A head staged in vocabulary chunks reads out what the whole head does: the chunks' partial
readouts, combined on the host, give the same argmax and log-probability as one softmax."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llada_jax.model.layered import partial_readout
from llada_jax.model.readout import HeadChunkReadout, Readout, TokenBiases, chunk_biases, combine_head_chunks
from llada_jax.model.steps import argmax_logprob


def chunked(logits: np.ndarray, biases: TokenBiases, rows: int) -> Readout:
    """The readout through chunks of `rows` vocabulary rows (the last zero-padded, as staging packs it)."""
    vocab = logits.shape[-1]
    chunks = -(-vocab // rows)
    padded = np.zeros((*logits.shape[:-1], chunks * rows), np.float32)
    padded[..., :vocab] = logits
    parts = []
    for c, part in enumerate(chunk_biases(biases, chunks, rows)):
        guided = jnp.asarray(padded[..., c * rows: (c + 1) * rows]) + part.logit_bias
        part_readout = partial_readout(guided, jnp.asarray(part.confidence_bias))
        parts.append(HeadChunkReadout(*map(np.asarray, part_readout)))
    return combine_head_chunks(parts, rows, vocab)


@settings(max_examples=40)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 70), rows=st.integers(1, 40),
       scale=st.sampled_from([0.1, 3.0, 40.0]), ties=st.booleans(), hidden=st.integers(0, 3))
@pytest.mark.slow
def test_chunked_readout_equals_the_whole_head(seed, vocab, rows, scale, ties, hidden):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(2, 5, vocab)) * scale).astype(np.float32)
    if ties:
        logits = np.round(logits)  # equal maxima, across chunk borders too
    forbid = rng.choice(vocab, size=min(hidden, vocab - 1), replace=False)
    unconfident = rng.choice(vocab, size=min(hidden, vocab), replace=False)
    biases = TokenBiases.build(vocab, forbid, unconfident)
    want_x0, want_logp = map(np.asarray, argmax_logprob(jnp.asarray(logits) + biases.logit_bias,
                                                        jnp.asarray(biases.confidence_bias)))
    got = chunked(logits, biases, rows)
    assert got.x0.tolist() == want_x0.tolist()
    assert (np.isneginf(got.logp) == np.isneginf(want_logp)).all()
    finite = np.isfinite(want_logp)
    np.testing.assert_allclose(got.logp[finite], want_logp[finite], rtol=1e-5, atol=1e-6)


def test_chunked_logits_are_the_whole_logits():
    logits = np.random.default_rng(0).normal(size=(1, 3, 10)).astype(np.float32)
    parts = [Readout(logits=logits[..., :4]), Readout(logits=logits[..., 4:8]),
             Readout(logits=np.concatenate([logits[..., 8:], np.full((1, 3, 2), -np.inf, np.float32)], -1))]
    np.testing.assert_array_equal(combine_head_chunks(parts, 4, 10).logits, logits)


def test_llada_8b_head_stages_in_chunks_no_larger_than_a_layer():
    """With the real 126464-token vocabulary, the largest staged piece is a layer, not the head."""
    import json

    from llada_jax.model.config import LLaDAConfig
    from llada_jax.staging.packing import head_chunks, head_layout, layer_layout
    from tests.conftest import LLADA_8B_DIR

    config = LLaDAConfig.from_hf_dict(json.loads((LLADA_8B_DIR / "config.json").read_text()))
    chunks, rows = head_chunks(config)
    assert (chunks, rows) == (3, 42240) and chunks * rows >= config.embedding_size > (chunks - 1) * rows
    assert head_layout(config).size < layer_layout(config).size
