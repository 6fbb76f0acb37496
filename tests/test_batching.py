"""Batched generation: every row of a batch decodes as its prompt alone (tokens, forward passes, trace),
for every policy, through XLA and IREE; the step batcher's rounds, joins, chunks, errors and cancellation."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.bundle_runner import bundle_runner
from llada_jax.system.errors import LladaError
from policies.backend import BackendCall
from policies.step_batcher import Cancelled, StepBatcher, _chunks
from tests.conftest import TINY

SETTINGS = [("vanilla", None), ("prefix-cache", None), ("dual-cache", None), ("dual-cache", 0.3),
            ("prefix-cache+speculative:1:0.3", None), ("dual-cache+speculative:2:0.3", 0.3),
            ("dual-cache+revision:0.4", 0.3), ("prefix-cache+speculative:1:0.3+revision:0.4", None)]


def prompts_of(lengths, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.mask_token_id, length) for length in lengths]


def trace_of(result) -> list[tuple]:
    """What each step computed and committed (its padded shape may differ: the batch's canvas is longer)."""
    return [(r.width, r.useful, r.positions, r.tokens, r.drafts, r.revisions) for r in result.trace]


def assert_rows_alone(batch, alone) -> None:
    assert len(batch) == len(alone)
    for row, (got, want) in enumerate(zip(batch, alone)):
        assert got.output_ids.tolist() == want.output_ids.tolist(), f"row {row}"
        assert got.nfe == want.nfe, f"row {row}"
        assert got.prompt_len == want.prompt_len
        assert trace_of(got) == trace_of(want), f"row {row}"


@settings(max_examples=12)
@given(setting=st.sampled_from(SETTINGS), lengths=st.lists(st.integers(1, 24), min_size=1, max_size=4),
       blocks=st.integers(1, 3), seed=st.integers(0, 1000))
@pytest.mark.slow
def test_each_row_decodes_as_alone(tiny_model, setting, lengths, blocks, seed):
    policy, threshold = setting
    options = dict(gen_length=8 * blocks, block_length=8, steps=4 * blocks, policy=policy, threshold=threshold,
                   loop="host")
    prompts = prompts_of(lengths, seed)
    batch = llada_jax.generate(tiny_model, prompts, **options)
    assert_rows_alone(batch, [llada_jax.generate(tiny_model, prompt, **options) for prompt in prompts])
    assert batch[0].stats.get("batch_rows", 1) == len(prompts)  # a batch of one decodes as that prompt alone


@settings(max_examples=4)
@given(lengths=st.lists(st.integers(1, 12), min_size=2, max_size=3), seed=st.integers(0, 1000))
@pytest.mark.slow
def test_cfg_and_sampling_rows_decode_as_alone(tiny_model, lengths, seed):
    """CFG stacks (conditional, unconditional) pairs; sampling draws from each row's own generator."""
    options = dict(gen_length=16, block_length=8, steps=8, cfg_scale=1.5, temperature=0.7, seed=seed,
                   policy="dual-cache", loop="host")
    prompts = prompts_of(lengths, seed)
    batch = llada_jax.generate(tiny_model, prompts, **options)
    assert_rows_alone(batch, [llada_jax.generate(tiny_model, prompt, **options) for prompt in prompts])


@pytest.mark.parametrize("policy, threshold", [("vanilla", None), ("dual-cache+speculative:1:0.3", 0.3),
                                               ("dual-cache+revision:0.4", None)])
@pytest.mark.slow
def test_iree_batch_rows_match_xla_alone(tiny_model, host_bundle, policy, threshold):
    """Three rows run through a bundle compiled for batches of 1 and 2: steps of 2 rows, then 1."""
    _, _, generate = bundle_runner(host_bundle)
    options = dict(gen_length=16, block_length=8, steps=8, policy=policy, threshold=threshold, loop="host")
    prompts = prompts_of([3, 11, 7], seed=5)
    batch = generate(prompts, **options)
    assert_rows_alone(batch, [llada_jax.generate(tiny_model, prompt, **options) for prompt in prompts])
    assert batch[0].stats["batched_calls"] < batch[0].stats["row_steps"]


def test_an_array_of_rows_is_a_batch_and_one_row_is_not(tiny_model):
    prompts = np.stack(prompts_of([5, 5], seed=1))
    options = dict(gen_length=8, block_length=8, steps=4, loop="host")
    batch = llada_jax.generate(tiny_model, prompts, **options)
    assert isinstance(batch, list) and len(batch) == 2
    single = llada_jax.generate(tiny_model, prompts[:1], **options)
    assert single.output_ids.tolist() == batch[0].output_ids.tolist()


@pytest.mark.parametrize("prompts, message", [
    ([[1, 2], [3, TINY.mask_token_id]], "prompt 1 holds the mask token"),
    ([[1, 2], [3, 9999]], "prompt 1 holds token id 9999"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[1, 2], [[1, 2], [3, 4]]], "prompt 1 must be one sequence"),
    ([[1] * 100, [2]], "the longest prompt (100) + gen_length (32) = 132 exceeds"),
])
def test_bad_batches_are_one_line_errors(tiny_model, prompts, message):
    with pytest.raises(LladaError, match=re.escape(message)):
        llada_jax.generate(tiny_model, prompts, gen_length=32, block_length=8, steps=8)


def test_a_batch_refuses_the_compiled_loop(tiny_model):
    with pytest.raises(LladaError, match="compiled loop decodes one prompt"):
        llada_jax.generate(tiny_model, prompts_of([3, 4], 0), gen_length=8, block_length=8, steps=8,
                           policy="dual-cache", loop="compiled")


class CountingBackend:
    """A fake backend: `full` returns the rows it got (tagged with the call number); fails on request."""

    def __init__(self, fail_rows: int | None = None):
        self.calls, self.reads, self.fail_rows = [], [], fail_rows

    def batch_sizes(self):
        return None

    def full(self, tokens, valid, reads=None):
        from llada_jax.model.readout import Readout, StepOutput

        if tokens.shape[0] == self.fail_rows:
            raise LladaError("device out of memory")
        self.calls.append(tokens.shape[0])
        self.reads.append(reads)
        read = tokens if reads is None else tokens[:, list(reads)]
        return StepOutput(Readout(x0=read.copy(), logp=np.zeros(read.shape)), np.zeros((1, tokens.shape[0])),
                          np.zeros((1, tokens.shape[0])))

    def split_rows(self, array, parts, axis):
        return np.split(array, parts, axis=axis)


def full_call(tokens, reads=None) -> BackendCall:
    return BackendCall("full", (tokens, np.ones(tokens.shape, bool), reads))


def steps_of(index: int, steps: int):
    """A row of `steps` full steps whose canvas holds 10 * index + step; returns what each read out."""
    got = []
    for step in range(steps):
        got.append((yield full_call(np.full((1, 4), 10 * index + step))).readout.x0[0, 0])
    return got


def run_rows(batcher: StepBatcher, rows: list) -> list:
    """Add each generator as a row and run rounds until none is left; each row's result (or error)."""
    ends = [None] * len(rows)
    for index, steps in enumerate(rows):
        batcher.add(steps, lambda result, error, seconds, index=index: ends.__setitem__(index, error or result))
    batcher.run()
    return ends


def test_rows_get_their_own_rows_of_one_call_and_finished_rows_do_not_block():
    backend = CountingBackend()

    rows = [steps_of(index, index + 1) for index in range(3)]  # row i makes i + 1 steps
    assert run_rows(StepBatcher(backend), rows) == [[0], [10, 11], [20, 21, 22]]
    assert backend.calls == [3, 2, 1]  # one call per round, shrinking as rows finish


def test_rows_reading_different_columns_share_a_call_and_get_their_own_columns():
    reads = [(1, 3), (0, 3), None]

    def row(index):  # a canvas whose column j holds 10 * row + j
        return (yield full_call(10 * index + np.arange(4)[None], reads[index])).readout.x0[0].tolist()

    backend = CountingBackend()
    assert run_rows(StepBatcher(backend), [row(index) for index in range(3)]) == [[1, 3], [10, 13], [20, 21, 22, 23]]
    assert backend.calls == [3] and backend.reads == [None]  # a row reading everything: all columns
    backend = CountingBackend()
    assert run_rows(StepBatcher(backend), [row(index) for index in range(2)]) == [[1, 3], [10, 13]]
    assert backend.reads == [(0, 1, 3)]


def test_a_failed_call_fails_its_rows_where_they_called_and_cancel_closes_a_row():
    closed = []

    def row():
        try:
            yield full_call(np.zeros((1, 4), int))
        finally:
            closed.append(True)

    results = run_rows(StepBatcher(CountingBackend(fail_rows=2)), [row(), row()])
    assert [str(result) for result in results] == ["device out of memory"] * 2 and closed == [True, True]

    batcher, ends = StepBatcher(CountingBackend()), []
    index = batcher.add(row(), lambda result, error, seconds: ends.append(error))
    batcher.cancel(index)
    assert isinstance(ends[0], Cancelled) and batcher.live == 0 and len(closed) == 3


def test_a_row_that_joins_between_rounds_runs_beside_the_others():
    backend = CountingBackend()
    batcher, ends = StepBatcher(backend), {}

    batcher.add(steps_of(0, 3), lambda result, error, seconds: ends.setdefault(0, result))
    batcher.round()
    batcher.add(steps_of(1, 2), lambda result, error, seconds: ends.setdefault(1, result))
    batcher.run()
    assert ends == {0: [0, 1, 2], 1: [10, 11]} and backend.calls == [1, 2, 2]


def test_chunks_follow_the_compiled_batch_sizes():
    calls = [BackendCall("full", (np.zeros((2, 8)), None, None)) for _ in range(5)]  # CFG: 2 rows per call
    assert [len(chunk) for chunk in _chunks(calls, (1, 2, 4))] == [2, 2, 1]
    assert [len(chunk) for chunk in _chunks(calls, None)] == [5]
    with pytest.raises(LladaError, match="no step for 2 rows"):
        _chunks(calls, (1, 3))
