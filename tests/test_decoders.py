"""Decoder properties: schedules, immutability of commits, cache equivalence at block starts."""

from __future__ import annotations

import dataclasses
import faulthandler
import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.model.readout import read_columns
from llada_jax.model.shapes import bucket
from llada_jax.model.steps import full_step
from llada_jax.system.errors import LladaError
from policies.cache_policies import DualCache, PrefixCache
from policies.canvas import Block, Canvas
from policies.canvas_steps import commit_window
from policies.loop import decode
from policies.registry import make_policy
from policies.sampling import Sampler
from policies.schedule import Schedule, make_rule
from tests.conftest import TINY, jax_backend, step_extras

POLICIES = ["vanilla", "prefix-cache", "dual-cache"]


def prompt(seed: int, length: int = 6) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY.mask_token_id, length)


class Recorder:
    """on_step callback keeping a copy of row 0 of the canvas after every step."""

    def __init__(self):
        self.canvases, self.records = [], []

    def __call__(self, canvas, record):
        self.canvases.append(canvas.tokens[0, : canvas.length].copy())
        self.records.append(record)


@settings(max_examples=12)
@given(policy=st.sampled_from(POLICIES), threshold=st.sampled_from([None, 0.2]), blocks=st.integers(1, 3),
       steps_per_block=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 1000))
def test_committed_tokens_never_change_and_commits_stay_in_their_block(tiny_model, policy, threshold, blocks,
                                                                       steps_per_block, seed):
    recorder = Recorder()
    ids = prompt(seed)
    result = llada_jax.generate(tiny_model, ids, gen_length=8 * blocks, block_length=8, steps=blocks * steps_per_block,
                                policy=policy, threshold=threshold, on_step=recorder)
    mask = TINY.mask_token_id
    previous = np.concatenate([ids, np.full(8 * blocks, mask)])
    for canvas, record in zip(recorder.canvases, recorder.records):
        committed = previous != mask
        assert (canvas[committed] == previous[committed]).all()
        start = len(ids) + 8 * record.block
        assert all(start <= p < start + 8 and previous[p] == mask for p in record.positions)
        assert len(set(record.positions)) == len(record.positions)
        previous = canvas
    assert (result.output_ids != mask).all()
    assert result.output_ids.tolist() == recorder.canvases[-1][len(ids):].tolist()


@settings(max_examples=10)
@given(policy=st.sampled_from(POLICIES), blocks=st.integers(1, 4), steps_per_block=st.sampled_from([1, 2, 4, 8]),
       seed=st.integers(0, 1000))
@pytest.mark.slow
def test_fixed_schedule_commits_gen_length_tokens_in_steps_forwards(tiny_model, policy, blocks, steps_per_block,
                                                                    seed):
    result = llada_jax.generate(tiny_model, prompt(seed), gen_length=8 * blocks, block_length=8,
                                steps=blocks * steps_per_block, policy=policy)
    assert result.nfe == blocks * steps_per_block
    assert sum(len(r.positions) for r in result.trace) == 8 * blocks
    per_step = 8 // steps_per_block
    assert all(len(r.positions) == per_step for r in result.trace)


def test_vanilla_runs_every_scheduled_step_even_when_steps_exceed_block_length(tiny_model):
    result = llada_jax.generate(tiny_model, prompt(1), gen_length=8, block_length=4, steps=12)
    assert result.nfe == 12
    assert [len(r.positions) for r in result.trace] == [1, 1, 1, 1, 0, 0] * 2


class WholeHead:
    """A backend running the LM head on every row of each step, then cutting the columns a step reads."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def full(self, tokens, valid, reads=None):
        out = self.inner.full(tokens, valid)
        return dataclasses.replace(out, readout=read_columns(out.readout, reads))

    def window(self, state, visible, ids, positions, valid, reads=None):
        out = self.inner.window(state, visible, ids, positions, valid)
        return dataclasses.replace(out, readout=read_columns(out.readout, reads))


@settings(max_examples=6)
@given(policy=st.sampled_from(POLICIES), threshold=st.sampled_from([None, 0.3]), seed=st.integers(0, 1000))
@pytest.mark.slow
def test_the_head_on_the_blocks_masks_decodes_as_the_head_on_every_row(tiny_model, policy, threshold, seed):
    """Each step's LM head runs on the block's masks alone, in the declared width covering them (8, 16 or
    32 rows of a 32-position block), and the generation is the one the head on every row gives."""
    ids, schedule = prompt(seed), Schedule(64, 32, 64)

    def run(backend):
        return decode(backend, ids, schedule, make_policy(policy), make_rule(schedule, threshold), Sampler(),
                      mask_id=TINY.mask_token_id, max_len=TINY.max_sequence_length)

    masks, whole = run(jax_backend(tiny_model)), run(WholeHead(jax_backend(tiny_model)))
    assert masks.output_ids.tolist() == whole.output_ids.tolist()
    assert [r.positions for r in masks.trace] == [r.positions for r in whole.trace]
    for record in masks.trace:
        assert record.read_rows == max(record.useful, 1)
        assert record.head_rows == bucket(record.read_rows, record.shape_width)
    if threshold is None:  # one commit per step: the masks run down from 32 to 1 in every block
        assert {r.head_rows for r in masks.trace} == {8, 16, 32}


@settings(max_examples=8)
@given(policy=st.sampled_from([PrefixCache(), DualCache()]), block_index=st.integers(0, 2),
       seed=st.integers(0, 1000))
def test_cache_at_block_start_equals_full_forward(tiny_model, policy, block_index, seed):
    """The K/V a cached decoder keeps at a block start are exactly the full forward's, slot for slot."""
    rng = np.random.default_rng(seed)
    ids = prompt(seed)
    canvas = Canvas.start(ids, 24, TINY.mask_token_id, cfg=False, max_len=TINY.max_sequence_length)
    start = len(ids) + 8 * block_index
    canvas.tokens[0, len(ids): start] = rng.integers(0, TINY.mask_token_id, start - len(ids))
    backend = jax_backend(tiny_model)
    state = backend.empty_state(1, canvas.padded_length)
    plan = policy.plan(canvas, Block(block_index, start, start + 8), 0, None)  # the block-start step
    window = plan.window(canvas)
    out = backend.full(canvas.tokens, canvas.valid)
    state = commit_window(backend, state, window, plan.keep_kv[window.positions], out, canvas.tokens, 0)
    _, keys, values = full_step(tiny_model.params, jnp.asarray(canvas.tokens), jnp.asarray(canvas.valid),
                                *step_extras(), config=TINY, readout_spec=backend.readout_spec)
    kept = np.flatnonzero(state.filled[0])
    expected = np.arange(start) if isinstance(policy, PrefixCache) else np.arange(canvas.length)
    assert kept.tolist() == expected.tolist()
    np.testing.assert_array_equal(np.asarray(state.keys)[:, 0, kept], np.asarray(keys)[:, 0, kept])
    np.testing.assert_array_equal(np.asarray(state.values)[:, 0, kept], np.asarray(values)[:, 0, kept])
    assert (state.slot_token[0, kept] == canvas.tokens[0, kept]).all()


@pytest.mark.parametrize("policy", POLICIES)
def test_sampling_options_are_seeded_and_fill_the_canvas(tiny_model, policy):
    kwargs = dict(gen_length=16, block_length=8, steps=8, temperature=0.8, cfg_scale=0.5, remasking="random",
                  policy=policy)
    first = llada_jax.generate(tiny_model, prompt(2), seed=3, **kwargs)
    again = llada_jax.generate(tiny_model, prompt(2), seed=3, **kwargs)
    other = llada_jax.generate(tiny_model, prompt(2), seed=4, **kwargs)
    assert first.output_ids.tolist() == again.output_ids.tolist()
    assert first.output_ids.tolist() != other.output_ids.tolist()
    assert (first.output_ids != TINY.mask_token_id).all()


def eos_loving(model, seed: int):
    """The tiny model with its EOS head row made a scaled copy of its favourite token's row."""
    output = llada_jax.generate(model, prompt(seed), gen_length=32, block_length=32, steps=32).output_ids
    values, counts = np.unique(output, return_counts=True)
    head = np.array(model.params["lm_head"])
    head[TINY.eos_token_id] = 1.05 * head[values[counts.argmax()]]
    return dataclasses.replace(model, params=dict(model.params, lm_head=jnp.asarray(head)))


def test_forbidding_eos_keeps_it_out_and_zero_confidence_delays_it(tiny_model):
    eos = TINY.eos_token_id
    model = eos_loving(tiny_model, 5)
    base = dict(gen_length=32, block_length=32, steps=32)
    plain = llada_jax.generate(model, prompt(5), **base)
    assert (plain.output_ids == eos).sum() >= 5
    forbidden = llada_jax.generate(model, prompt(5), logits_eos_inf=True, **base)
    assert eos not in forbidden.output_ids
    late = llada_jax.generate(model, prompt(5), confidence_eos_eot_inf=True, **base)
    eos_steps = [r.nfe for r in late.trace for t, c in zip(r.tokens, r.confidence) if t == eos and c == 0.0]
    eos_commits = [r.nfe for r in late.trace for t in r.tokens if t == eos]
    assert eos_steps == eos_commits and len(eos_commits) >= 1
    plain_eos_commits = [r.nfe for r in plain.trace for t in r.tokens if t == eos]
    assert min(eos_commits) > min(plain_eos_commits)  # zero confidence pushes EOS to the end


@pytest.mark.parametrize("policy, threshold", [("prefix-cache", None), ("dual-cache", 0.5), ("dual-cache", None)])
def test_a_model_that_predicts_the_mask_token_ends_each_block(tmp_path, policy, threshold):
    """The reference loops never end when the model keeps predicting the mask token; each block here ends after
    max(steps per block, block length) steps, host and compiled loops alike, the masks left in place."""
    from llada_jax.model.params import init_params
    from llada_jax.weights.checkpoint import save_hf

    config = dataclasses.replace(TINY, mask_token_id=0)
    params = init_params(config, seed=0)
    params["ln_f"] = jnp.zeros_like(params["ln_f"])  # every logit 0: the argmax is token 0, the mask
    model = llada_jax.load(save_hf(params, config, tmp_path / "masks"))
    options = dict(gen_length=16, block_length=8, steps=4, policy=policy, threshold=threshold)
    faulthandler.dump_traceback_later(600, exit=True)  # a loop that never ends fails here, not at CI's timeout
    try:
        results = [llada_jax.generate(model, np.arange(1, 6), loop=loop, **options) for loop in ("host", "compiled")]
    finally:
        faulthandler.cancel_dump_traceback_later()
    for result in results:
        assert result.output_ids.tolist() == [0] * 16 and result.nfe == 2 * 8


@pytest.mark.parametrize("options, message", [
    (dict(gen_length=8, block_length=8, steps=8, polcy="dual-cache"), "unknown generation option polcy; the options "
                                                                      "are gen_length, block_length, steps,"),
    (dict(block_length=8), "generation needs gen_length, steps"),
    (dict(gen_length=8.5, block_length=8, steps=8), "generation option gen_length must be an integer, got 8.5"),
    (dict(gen_length=True, block_length=8, steps=8), "generation option gen_length must be an integer, got True"),
    (dict(gen_length=8, block_length=8, steps=8, temperature="hot"), "temperature must be a number, got 'hot'"),
    (dict(gen_length=8, block_length=8, steps=8, threshold="a"), "threshold must be a number or None, got 'a'"),
    (dict(gen_length=8, block_length=8, steps=8, seed=-1), "generation option seed must be >= 0, got -1"),
    (dict(gen_length=8, block_length=8, steps=8, temperature=float("inf")), "temperature must be a finite number"),
    (dict(gen_length=8, block_length=8, steps=8, cfg_scale=np.float32("nan")), "cfg_scale must be a finite number"),
    (dict(gen_length=8, block_length=8, steps=8, cfg_scale=1e308), "cfg_scale must be at most 100.0"),
    (dict(gen_length=8, block_length=8, steps=8, limit=np.int64(0)), "limit must be a positive length, got 0"),
    (dict(gen_length=8, block_length=8, steps=8, policy=""), "policy must name a decoder"),
    (dict(gen_length=8, block_length=8, steps=8, policy="dual-cache@0.9"),
     "a policy names no threshold: give policy='dual-cache', threshold=0.9"),
    (dict(gen_length=8, block_length=8, steps=10**12), "steps=1000000000000 is more than this decoder counts"),
    (dict(gen_length=8, block_length=8, steps=8, on_step=5), "on_step must be a function"),
])
def test_unknown_or_missing_options_are_one_line_errors(tiny_model, options, message):
    with pytest.raises(LladaError, match=re.escape(message)) as error:
        llada_jax.generate(tiny_model, [1, 2, 3], **options)
    assert "\n" not in str(error.value)


def test_numpy_scalars_are_the_values_they_hold(tiny_model):
    plain = llada_jax.generate(tiny_model, [1, 2, 3], gen_length=8, block_length=8, steps=8, limit=64)
    numpy = llada_jax.generate(tiny_model, [1, 2, 3], gen_length=np.int64(8), block_length=np.int32(8),
                               steps=np.int16(8), limit=np.int64(64), temperature=np.float32(0))
    assert numpy.output_ids.tolist() == plain.output_ids.tolist()


@pytest.mark.parametrize("call, message", [
    (lambda model: llada_jax.generate(model, [10, [11, 12]], gen_length=8, block_length=8, steps=8),
     "prompt must be token ids, or rows of them of one length"),
    (lambda model: llada_jax.logits(model, [[10, 11], [12]]), "ids must be token ids, or rows of them of one length"),
    (lambda model: llada_jax.generate(None, [1, 2], gen_length=8, block_length=8, steps=8),
     "expected a model from llada_jax.load, got NoneType"),
    (lambda model: llada_jax.load(None), "load takes a model directory's path, got None"),
    (lambda model: llada_jax.load(".", device_memory_budget="1GB"), "device memory budget must be a number of bytes"),
    (lambda model: llada_jax.load(model.path, mesh="data=2"), "mesh must be a jax Mesh with axes ('data', 'model')"),
    *[(lambda model, value=value: llada_jax.logits(model, [[1, 2]], block_length=value),
       f"block_length must be an integer, got {value!r}") for value in (True, 2.0, "2")],
])
def test_arguments_of_the_wrong_kind_are_one_line_errors(tiny_model, call, message):
    with pytest.raises(LladaError, match=re.escape(message)) as error:
        call(tiny_model)
    assert "\n" not in str(error.value)
