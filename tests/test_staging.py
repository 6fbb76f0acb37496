"""Swap-optimized staging: staged execution equals resident execution; the ring reuses its slots,
overlaps copies with compute, and a budget too small is refused with the minimum."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.staging.packing import head_chunks, head_layout, layer_layout
from llada_jax.staging.swap import StagingRing, StagingStats, kv_bytes
from llada_jax.system.errors import LladaError
from tests.conftest import TINY

POLICIES = ["vanilla", "prefix-cache", "dual-cache", "dual-cache+speculative:1:0.3+revision:0.5"]


def check_staged_bytes(stats: dict, stages, nfe: int) -> None:
    """A generation copies its pinned stages (the largest) once and the others on every pass: at least
    one pass per dense step (a revision side path running staged adds passes)."""
    sizes = sorted((p.nbytes for p in stages), reverse=True)
    pinned, streamed = sum(sizes[: stats["pinned_stages"]]), sum(sizes[stats["pinned_stages"]:])
    if streamed == 0:  # every stage pinned: each copied once
        assert stats["bytes_staged"] == pinned
        return
    passes, rest = divmod(stats["bytes_staged"] - pinned, streamed)
    assert rest == 0 and passes >= nfe


@settings(max_examples=10)
@given(fraction=st.floats(0.0, 0.6), policy=st.sampled_from(POLICIES), seed=st.integers(0, 500),
       threshold=st.sampled_from([None, 0.3]))
@pytest.mark.slow
def test_staged_equals_resident(tiny_dir, tiny_model, fraction, policy, seed, threshold):
    slot = 4 * max(layer_layout(TINY).size, head_layout(TINY).size)
    budget = slot + kv_bytes(TINY, 2, 32, 4) + int(fraction * (tiny_model.weight_bytes - slot))
    staged = llada_jax.load(tiny_dir, device_memory_budget=budget)
    assert staged.staged is not None and staged.params is None
    prompt = np.random.default_rng(seed).integers(0, TINY.mask_token_id, 6)
    options = dict(gen_length=16, block_length=8, steps=8, policy=policy, threshold=threshold)
    want = llada_jax.generate(tiny_model, prompt, **options)
    got = llada_jax.generate(staged, prompt, **options)
    assert got.output_ids.tolist() == want.output_ids.tolist()
    check_staged_bytes(got.stats, staged.staged.stages, got.nfe)
    ids = np.random.default_rng(seed).integers(0, TINY.vocab_size, (2, 20))
    np.testing.assert_allclose(llada_jax.logits(staged, ids), llada_jax.logits(tiny_model, ids), atol=1e-6, rtol=0)


def test_budget_too_small_names_the_minimum(tiny_dir):
    """The refusal names the largest piece and a minimum that runs. The head (vocab 512, 1.8 layers) is
    staged in two chunks, so the largest piece is a decoder layer."""
    assert head_chunks(TINY) == (2, 256)
    options = dict(gen_length=8, block_length=8, steps=8)
    staged = llada_jax.load(tiny_dir, device_memory_budget=20_000)
    with pytest.raises(LladaError, match=r"too small: the largest staged piece \(one decoder layer, \d+ "
                                         r"bytes\) plus the KV state \(\d+ bytes\) need at least (\d+) bytes") as error:
        llada_jax.generate(staged, np.arange(3, 9), **options)
    minimum = int(re.search(r"at least (\d+) bytes", str(error.value)).group(1))
    with pytest.raises(LladaError, match=f"at least {minimum} bytes"):
        llada_jax.generate(llada_jax.load(tiny_dir, device_memory_budget=minimum - 1), np.arange(3, 9), **options)
    result = llada_jax.generate(llada_jax.load(tiny_dir, device_memory_budget=minimum), np.arange(3, 9), **options)
    assert result.stats["pinned_stages"] == 0 and result.stats["bytes_staged"] > 0


def test_budget_that_fits_keeps_weights_resident(tiny_dir, tiny_model):
    model = llada_jax.load(tiny_dir, device_memory_budget=10 * tiny_model.weight_bytes)
    assert model.staged is None and model.params is not None


def test_ring_reuses_slots_and_overlaps_copies_with_compute():
    stages = tuple(np.full(1000, i, np.float32) for i in range(7))
    in_slot, log, lock = {}, [], threading.Lock()

    def upload(slot, stage):
        time.sleep(0.01)
        with lock:
            assert slot not in in_slot, "a slot was overwritten while its stage was still in use"
            in_slot[slot] = int(stages[stage][0])
            log.append(("copy", int(stages[stage][0]), slot))
        return slot

    def compute(stage, slot):
        with lock:
            assert in_slot.pop(slot) == stage
            log.append(("compute", stage, slot))
        time.sleep(0.02)

    stats = StagingStats()
    ring = StagingRing(stages, 3, upload, stats)  # two streaming slots, one pinning the first stage
    ring.run(compute)
    assert [entry[1] for entry in log if entry[0] == "compute"] == list(range(7))
    assert {slot for kind, _, slot in log} == {0, 1, 2}
    assert stats.bytes_staged == 7 * 4000 and stats.pinned_stages == 1
    assert stats.hidden_fraction > 0.5  # copies of later stages ran while earlier ones computed
    in_slot[2] = 0  # the pinned stage stays in its slot
    log.clear()
    ring.run(compute)
    assert [entry[1] for entry in log if entry[0] == "compute"] == list(range(7))
    assert [stage for kind, stage, _ in log if kind == "copy"] == list(range(1, 7))  # not copied again
    assert stats.bytes_staged == 13 * 4000


def test_ring_pins_the_largest_stages_and_surfaces_copy_failures():
    stages = (np.zeros(10), np.zeros(30), np.zeros(20), np.zeros(10))
    ring = StagingRing(stages, 3, lambda slot, stage: slot, StagingStats())
    assert ring.pinned_buffer == {1: 2} and ring._buffer(0) == 0 and ring._buffer(2) == 1 and ring._buffer(3) == 0
    everything = StagingRing(stages, 4, lambda slot, stage: slot, StagingStats())
    assert sorted(everything.pinned_buffer) == [0, 1, 2, 3]

    def failing(slot, stage):
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        StagingRing(stages, 2, failing, StagingStats()).run(lambda stage, slot: None)
