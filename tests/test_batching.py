"""Batched generation: every row of a batch decodes as its prompt alone (tokens, forward passes, trace),
for every policy, through XLA and IREE; the step batcher's rounds, chunks, errors and cancellation."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.bundle_runner import bundle_runner
from llada_jax.errors import LladaError
from llada_jax.step_batcher import Cancelled, StepBatcher, _Call, _chunks
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
        from llada_jax.readout import Readout, StepOutput

        if tokens.shape[0] == self.fail_rows:
            raise LladaError("device out of memory")
        self.calls.append(tokens.shape[0])
        self.reads.append(reads)
        read = tokens if reads is None else tokens[:, list(reads)]
        return StepOutput(Readout(x0=read.copy(), logp=np.zeros(read.shape)), np.zeros((1, tokens.shape[0])),
                          np.zeros((1, tokens.shape[0])))

    def split_rows(self, array, parts, axis):
        return np.split(array, parts, axis=axis)


def run_rows(batcher: StepBatcher, rows: list, work) -> list:
    """`work(row_backend, index)` on a thread per row; results (or raised errors) in row order."""
    results = [None] * len(rows)

    def run(index):
        try:
            results[index] = work(rows[index], index)
        except Exception as error:
            results[index] = error
        finally:
            rows[index].leave()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(rows))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    batcher.close()
    return results


def test_rows_get_their_own_rows_of_one_call_and_leaving_rows_do_not_block():
    backend = CountingBackend()
    batcher = StepBatcher(backend)
    rows = [batcher.join() for _ in range(3)]

    def work(row, index):  # row i makes i + 1 steps
        return [row.full(np.full((1, 4), 10 * index + step), np.ones((1, 4), bool)).readout.x0[0, 0]
                for step in range(index + 1)]

    assert run_rows(batcher, rows, work) == [[0], [10, 11], [20, 21, 22]]
    assert backend.calls == [3, 2, 1]  # one call per round, shrinking as rows finish


def test_rows_reading_different_columns_share_a_call_and_get_their_own_columns():
    backend = CountingBackend()
    batcher = StepBatcher(backend)
    rows = [batcher.join() for _ in range(3)]
    reads = [(1, 3), (0, 3), None]

    def work(row, index):  # a canvas whose column j holds 10 * row + j
        tokens = 10 * index + np.arange(4)[None]
        return row.full(tokens, np.ones((1, 4), bool), reads[index]).readout.x0[0].tolist()

    assert run_rows(batcher, rows, work) == [[1, 3], [10, 13], [20, 21, 22, 23]]
    assert backend.calls == [3] and backend.reads == [None]  # a row reading everything: all columns
    backend = CountingBackend()
    batcher = StepBatcher(backend)
    rows = [batcher.join() for _ in range(2)]
    assert run_rows(batcher, rows, work) == [[1, 3], [10, 13]]
    assert backend.reads == [(0, 1, 3)]


def test_a_failed_call_fails_its_rows_and_cancel_stops_a_row():
    batcher = StepBatcher(CountingBackend(fail_rows=2))
    rows = [batcher.join() for _ in range(2)]
    results = run_rows(batcher, rows, lambda row, index: row.full(np.zeros((1, 4), int), np.ones((1, 4), bool)))
    assert [str(result) for result in results] == ["device out of memory"] * 2

    batcher = StepBatcher(CountingBackend())
    row = batcher.join()
    batcher.cancel(row.row)
    with pytest.raises(Cancelled):
        row.full(np.zeros((1, 4), int), np.ones((1, 4), bool))
    batcher.close()


def test_joins_and_cancels_do_not_wait_for_a_running_step():
    """A server cancels from its event loop: that must not wait for the device step a round is running."""
    gate = threading.Event()

    class Slow(CountingBackend):
        def full(self, *args):
            gate.wait(30)
            return super().full(*args)

    batcher = StepBatcher(Slow())
    row = batcher.join()
    running = threading.Thread(target=lambda: run_rows(batcher, [row], lambda r, i: r.full(
        np.zeros((1, 4), int), np.ones((1, 4), bool))))
    running.start()
    while not batcher._dispatcher or batcher._pending:  # the round has taken the call
        time.sleep(0.01)
    others = threading.Thread(target=lambda: (batcher.join().leave(), batcher.cancel(row.row)))
    others.start()
    others.join(timeout=10)
    stuck = others.is_alive()
    gate.set()
    running.join()
    batcher.close()
    assert not stuck


def test_chunks_follow_the_compiled_batch_sizes():
    calls = [_Call("full", (np.zeros((2, 8)), None, None)) for _ in range(5)]  # CFG: 2 rows per call
    assert [len(chunk) for chunk in _chunks(calls, (1, 2, 4))] == [2, 2, 1]
    assert [len(chunk) for chunk in _chunks(calls, None)] == [5]
    with pytest.raises(LladaError, match="no step for 2 rows"):
        _chunks(calls, (1, 3))
