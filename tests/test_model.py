"""The JAX forward against the float64 oracle, and the fixed-shape steps against each other."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.model import kv_state, layout
from llada_jax.model.forward import Context, decoder_layer, forward, lm_logits, rotary_tables
from llada_jax.model.layout import (
    IREE_CPU_LAYOUT,
    POSITION_MAJOR,
    XLA_LAYOUT,
    Features,
    OpenFeatures,
    Positions,
    linear,
    split_sum,
)
from llada_jax.model.readout import ReadoutSpec, StepOutput, head_rows_for
from llada_jax.model.shapes import bucket
from llada_jax.model.steps import argmax_logprob, full_step, guided_logits, head_rows, window_step
from llada_jax.quant.qlinear import to_device
from llada_jax.quant.quantize import HostQuantized, QuantScheme, quantize_matrix
from tests import reference
from tests.conftest import TINY, assert_close_to_scale, jax_backend, read_all, step_extras

LOGITS = ReadoutSpec(kind="logits")


def random_ids(seed: int, shape, with_masks: bool = True) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, TINY.vocab_size, shape)
    if with_masks:
        ids[rng.random(shape) < 0.3] = TINY.mask_token_id
    return ids


@settings(max_examples=10)
@given(batch=st.integers(1, 3), length=st.integers(1, 70), seed=st.integers(0, 10_000))
@pytest.mark.slow
def test_logits_match_float64_oracle(tiny_model, tiny_dir, batch, length, seed):
    ids = random_ids(seed, (batch, length))
    expected, _ = reference.forward(read_all(tiny_dir), TINY, ids)
    got = llada_jax.logits(tiny_model, ids)
    assert got.shape == (batch, length, TINY.embedding_size) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-4)


def full_outputs(model, ids: np.ndarray, slots: int):
    padded = np.full((1, slots), TINY.mask_token_id, np.int32)
    padded[0, : ids.size] = ids
    valid = np.arange(slots)[None] < ids.size
    return full_step(model.params, jnp.asarray(padded), jnp.asarray(valid), *step_extras(), config=TINY,
                     readout_spec=LOGITS)


@settings(max_examples=15)
@given(length=st.integers(2, 60), data=st.data(), seed=st.integers(0, 10_000))
def test_window_with_fresh_cache_equals_full_forward(tiny_model, length, data, seed):
    ids = random_ids(seed, (length,))
    slots = 64
    out, keys, values = full_outputs(tiny_model, ids, slots)
    start = data.draw(st.integers(0, length - 1))
    end = data.draw(st.integers(start + 1, length))
    width = data.draw(st.sampled_from([w for w in (8, 16, 32, 64) if w >= end - start]))
    everything = np.arange(slots)[None]
    backend = jax_backend(tiny_model)
    state = backend.commit(backend.empty_state(1, slots), everything, everything < length,
                           StepOutput({}, keys, values), np.pad(ids, (0, slots - length))[None], nfe=0)
    visible = (everything < length) & ~((everything >= start) & (everything < end))
    positions = np.zeros((1, width), np.int32)
    positions[0, : end - start] = np.arange(start, end)
    window_valid = np.arange(width)[None] < end - start
    window_out, window_keys, _ = window_step(
        tiny_model.params, Context(state.keys, state.values, jnp.asarray(kv_state.visible_bias(state, visible))),
        jnp.asarray(np.where(window_valid, ids[positions], 0)), jnp.asarray(positions), jnp.asarray(window_valid),
        *step_extras(), config=TINY, readout_spec=LOGITS)
    n = end - start
    assert_close_to_scale(np.asarray(window_out.logits)[0, :n], np.asarray(out.logits)[0, start:end])
    assert_close_to_scale(np.asarray(window_keys)[:, 0, :n], np.asarray(keys)[:, 0, start:end])


@settings(max_examples=8)
@given(length=st.integers(1, 32), seed=st.integers(0, 10_000))
def test_padding_to_a_larger_bucket_changes_nothing(tiny_model, length, seed):
    ids = random_ids(seed, (length,))
    small = np.asarray(full_outputs(tiny_model, ids, 32)[0].logits)[0, :length]
    large = np.asarray(full_outputs(tiny_model, ids, 128)[0].logits)[0, :length]
    assert_close_to_scale(small, large, tol=3e-5)  # another bucket is another matmul shape: sums reorder


def test_argmax_readout_agrees_with_logits(tiny_model):
    ids = random_ids(7, (40,))
    logits = np.asarray(full_outputs(tiny_model, ids, 64)[0].logits, np.float64)[0, :40]
    padded = np.full((1, 64), TINY.mask_token_id, np.int32)
    padded[0, :40] = ids
    out, _, _ = full_step(tiny_model.params, jnp.asarray(padded), jnp.asarray(np.arange(64)[None] < 40),
                          *step_extras(unconfident=(3,)), config=TINY, readout_spec=ReadoutSpec())
    x0 = np.asarray(out.x0)[0, :40]
    assert x0.tolist() == logits.argmax(-1).tolist()
    scored = logits.copy()
    scored[:, 3] = -np.inf
    probs = np.exp(scored - scored.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.exp(np.asarray(out.logp, np.float64)[0, :40]),
                               probs[np.arange(40), x0], rtol=1e-5)


def test_each_shape_compiles_once(tiny_model):
    llada_jax.logits(tiny_model, random_ids(1, (1, 20)))
    before = full_step._cache_size()
    for length in (17, 25, 32):  # all in the 32 bucket
        llada_jax.logits(tiny_model, random_ids(length, (1, length)))
    assert full_step._cache_size() == before


def test_bfloat16_compute_is_close_to_float32(tiny_dir, tiny_model):
    model16 = llada_jax.load(tiny_dir, dtype="bfloat16")
    ids = random_ids(3, (1, 30))
    low, high = llada_jax.logits(model16, ids), llada_jax.logits(tiny_model, ids)
    assert low.dtype == np.float32
    assert np.abs(low - high).max() < 0.1 * np.abs(high).max()


@settings(max_examples=20)
@given(rows=st.integers(1, 5), inner=st.integers(1, 300), out=st.integers(1, 40), seed=st.integers(0, 10_000))
def test_bfloat16_linear_accumulates_in_float32(rows, inner, out, seed):
    """bf16 weights are consumed as stored and summed in float32: the result is the float32 product of
    the bf16 values, rounded once to bf16 (a bf16 accumulator would drift far more over 300 terms)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(1, rows, inner)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(out, inner)), jnp.bfloat16)
    got = linear(x, w)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert got.dtype == jnp.bfloat16
    spacing = np.abs(exact) * 2.0 ** -8 + 1e-6 * np.sqrt(inner)  # one bf16 rounding of the float32 sum
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= spacing)


def quantized_block(block: dict, scheme: QuantScheme | None) -> dict:
    """The block with each matrix quantized to `scheme` (float activations); None: as it is."""
    if scheme is None:
        return block
    return {name: to_device(HostQuantized.of(*quantize_matrix(np.asarray(w), scheme), scheme)) if w.ndim == 2 else w
            for name, w in block.items()}


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 3), width=st.integers(1, 40), cached=st.integers(0, 24), seed=st.integers(0, 10_000),
       scheme=st.sampled_from([None, QuantScheme(8), QuantScheme(4, 16)]),
       columns=st.sampled_from([Features, OpenFeatures]))
@pytest.mark.slow
def test_feature_major_layer_equals_position_major(tiny_model, batch, width, cached, seed, scheme, columns):
    """The layer computed with one column per position (XLA's fenced form or IREE's open one) gives the
    position-major layer's x, K and V, with float or weight-only quantized matrices."""
    rng = np.random.default_rng(seed)
    block = quantized_block(tiny_model.params["blocks"][1], scheme)
    x = jnp.asarray(rng.normal(size=(batch, width, TINY.d_model)), jnp.float32)
    rotary = rotary_tables(jnp.asarray(rng.integers(0, 100, (batch, width))), TINY.head_dim, TINY.rope_theta)
    kv = (batch, cached, TINY.n_kv_heads, TINY.head_dim)
    context = (jnp.asarray(rng.normal(size=kv), jnp.float32), jnp.asarray(rng.normal(size=kv), jnp.float32))
    bias = jnp.asarray(np.where(rng.random((batch, cached + width)) < 0.2, kv_state.HIDDEN, 0.0), jnp.float32)
    run = jax.jit(decoder_layer, static_argnames=("config", "layout"))
    by_position = run(block, x, rotary, context, bias, config=TINY, layout=Positions)
    by_feature = run(block, x, rotary, context, bias, config=TINY, layout=columns)
    for got, want in zip(by_feature, by_position):
        assert_close_to_scale(np.asarray(got), np.asarray(want))


SHORT_OR_LONG = st.one_of(st.tuples(st.integers(1, 1024), st.integers(1, 260)),   # sums not split
                         st.tuples(st.integers(1, 3000), st.integers(1, 127)),
                         st.tuples(st.integers(1025, 3000), st.integers(128, 260)))  # split


@settings(max_examples=12, deadline=None)
@given(out=st.integers(1, 48), shape=SHORT_OR_LONG, dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       seed=st.integers(0, 10_000))
def test_piecewise_feature_products_split_long_sums_and_equal_the_whole_product(out, shape, dtype, seed):
    """IREE's feature-major product sums over more than SPLIT_SUM features on at least
    SPLIT_COLUMNS columns in consecutive pieces of at most SUM_PIECE, and gives the one-piece product to
    float32 rounding."""
    features, columns = shape
    pieces = split_sum(features, columns)
    assert pieces[0][0] == 0 and pieces[-1][1] == features
    assert all(stop == start for (_, stop), (start, _) in zip(pieces, pieces[1:]))
    if columns >= layout.SPLIT_COLUMNS and features > layout.SPLIT_SUM:
        assert all(0 < stop - start <= layout.SUM_PIECE for start, stop in pieces)
    else:
        assert pieces == [(0, features)]
    rng = np.random.default_rng(seed)
    weight = jnp.asarray(rng.normal(size=(out, features)), dtype)
    h = jnp.asarray(rng.normal(size=(features, columns)), jnp.float32)
    got = np.asarray(jax.jit(OpenFeatures.matmul)(h, weight), np.float64)
    w64, h64 = np.asarray(weight, np.float64), np.asarray(h, np.float64)
    rounding = 2 * features * np.finfo(np.float32).eps * (np.abs(w64) @ np.abs(h64))  # float32 sums, any order
    assert np.all(np.abs(got - w64 @ h64) <= rounding)


def test_layout_rules_pick_by_width_and_weights(tiny_model):
    """XLA goes feature-major up to its row limit, fenced; IREE's CPU rules at every width, open, summing long
    products in pieces; W8A8 weights and the Vulkan rule stay position-major."""
    block = tiny_model.params["blocks"][0]
    assert XLA_LAYOUT.pick(XLA_LAYOUT.feature_rows, block) is Features
    assert XLA_LAYOUT.pick(XLA_LAYOUT.feature_rows + 1, block) is Positions
    assert IREE_CPU_LAYOUT.pick(4096, block) is OpenFeatures
    assert POSITION_MAJOR.pick(1, block) is Positions
    w8a8 = {name: to_device(HostQuantized.of(*quantize_matrix(np.asarray(w), QuantScheme(8)), QuantScheme(8)),
                            activations="int8") if w.ndim == 2 else w for name, w in block.items()}
    assert IREE_CPU_LAYOUT.pick(1, w8a8) is Positions


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 3), width=st.integers(1, 40), dtype=st.sampled_from(["float32", "bfloat16"]),
       seed=st.integers(0, 10_000))
def test_feature_major_lm_head_equals_the_plain_product(tiny_model, batch, width, dtype, seed):
    """The head on few rows, computed as `W @ h` and transposed back, is hidden @ head.T in float32."""
    rng = np.random.default_rng(seed)
    head = {"lm_head": tiny_model.params["lm_head"].astype(dtype)}
    hidden = jnp.asarray(rng.normal(size=(batch, width, TINY.d_model)), dtype)
    run = jax.jit(lm_logits, static_argnames="layout_rule")
    exact = np.asarray(hidden, np.float64) @ np.asarray(head["lm_head"], np.float64).T
    for rule in (POSITION_MAJOR, XLA_LAYOUT, IREE_CPU_LAYOUT):
        got = run(head, hidden, layout_rule=rule)
        assert got.dtype == jnp.float32 and got.shape == (batch, width, TINY.embedding_size)
        assert_close_to_scale(np.asarray(got, np.float64), exact)


@settings(max_examples=30, deadline=None)
@given(pairs=st.integers(1, 2), width=st.integers(1, 9), vocab=st.integers(2, 70), cfg=st.booleans(),
       ties=st.booleans(), hidden=st.integers(0, 3), nan=st.booleans(), seed=st.integers(0, 10_000))
@pytest.mark.slow
def test_readout_over_vocabulary_columns_equals_the_row_readout(pairs, width, vocab, cfg, ties, hidden, nan, seed):
    """Guided logits and the argmax readout reduced over a leading vocabulary axis `[E, B, W]` (how a
    feature-major head leaves them) give the tokens and log-probabilities of the `[B, W, E]` readout."""
    rng = np.random.default_rng(seed)
    rows = (rng.normal(size=(2 * pairs, width, vocab)) * 4).astype(np.float32)
    if ties:
        rows = np.round(rows)
    if nan:
        rows[0, 0, rng.integers(vocab)] = np.nan
    logit_bias, confidence_bias = np.zeros(vocab, np.float32), np.zeros(vocab, np.float32)
    logit_bias[rng.choice(vocab, size=min(hidden, vocab - 1), replace=False)] = -np.inf
    confidence_bias[rng.choice(vocab, size=min(hidden, vocab), replace=False)] = -np.inf
    spec = ReadoutSpec(kind="argmax", cfg=cfg)

    def read(logits, axis):
        guided = guided_logits(jnp.asarray(logits), jnp.float32(0.5), jnp.asarray(logit_bias), spec, axis)
        return map(np.asarray, argmax_logprob(guided, jnp.asarray(confidence_bias), axis))

    want_x0, want_logp = read(rows, -1)
    got_x0, got_logp = read(np.moveaxis(rows, -1, 0), 0)
    assert got_x0.shape == want_x0.shape == ((pairs if cfg else 2 * pairs), width)
    fine = ~np.isnan(want_logp)
    assert (np.isnan(got_logp) == ~fine).all()
    assert got_x0[fine].tolist() == want_x0[fine].tolist()
    assert (np.isneginf(got_logp) == np.isneginf(want_logp)).all()
    finite = np.isfinite(want_logp)
    np.testing.assert_allclose(got_logp[finite], want_logp[finite], rtol=1e-5, atol=1e-6)


@settings(max_examples=30)
@given(batch=st.integers(1, 3), rows=st.integers(1, 40), data=st.data())
def test_head_rows_are_the_rows_they_name(batch, rows, data):
    """The head runs on the rows a step reads, padded to a declared width by repeating the last: its first
    len(reads) rows are exactly the rows named, in order."""
    reads = tuple(sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1))))
    padded = head_rows_for(reads, rows)
    assert padded.size == bucket(len(reads), rows) and padded.size >= len(reads)
    assert padded[len(reads):].tolist() == [reads[-1]] * (padded.size - len(reads))
    hidden = np.arange(batch * rows * 3, dtype=np.float32).reshape(batch, rows, 3)
    got = np.asarray(head_rows(jnp.asarray(hidden), padded))
    assert np.array_equal(got[:, :len(reads)], hidden[:, list(reads)])
    assert head_rows(jnp.asarray(hidden), None).shape == hidden.shape
    assert head_rows_for(None, rows).tolist() == list(range(rows))


def test_head_rows_refuse_columns_out_of_order_or_range():
    for reads in [(), (3, 2), (1, 1), (0, 8)]:
        with pytest.raises(ValueError, match="read-out columns"):
            head_rows_for(reads, 8)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_head_on_few_rows_makes_no_float32_copy_of_itself(dtype):
    """XLA ran a bf16 head feature-major as a float32 matmul on a float32 copy of the whole head (LLaDA-8B:
    2 GB per step); it runs position-major instead. A float32 head needs no copy either way."""
    from llada_jax.model.forward import head_logits

    vocab, width = 8192, 256
    params = {"lm_head": jax.ShapeDtypeStruct((vocab, width), dtype)}
    hidden = jax.ShapeDtypeStruct((1, 32, width), dtype)
    compiled = jax.jit(lambda p, h: head_logits(p, h)[0]).lower(params, hidden).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < vocab * width * 4 // 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float32_steps_multiply_in_float32_on_every_backend(tiny_dir, dtype):
    """Every matmul of a float32 step asks for HIGHEST precision (XLA's default on NVIDIA GPUs is TF32, another
    dtype than a CPU's and PyTorch's float32); bf16 steps keep the default."""
    model = llada_jax.load(tiny_dir, dtype=dtype)
    ids = jnp.zeros((1, 8), jnp.int32)
    lowered = jax.jit(forward, static_argnames=("config",)).lower(
        model.params, ids, jnp.arange(8)[None], jnp.zeros((1, 8)), None, config=model.config).as_text()
    dots = [line for line in lowered.splitlines() if "dot_general" in line]
    assert dots and all(("precision = [HIGHEST, HIGHEST]" in line) == (dtype == "float32") for line in dots)
